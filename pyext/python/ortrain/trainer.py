"""ORTTrainer: the whole train step — forward, loss, backward, gradient clipping and the
optimizer update — in the engine, with ONNX Runtime Training's API (model_desc, optim_config,
loss_fn, options; train_step, eval_step, save_as_onnx, state_dict, load_state_dict).

`options['distributed']` (world_rank, world_size, allreduce_post_accumulation,
deepspeed_zero_optimization) trains data parallel over torch.distributed as ORT did: rank 0's
weights broadcast at construction, the gradients averaged over the ranks before each update,
with ZeRO stage 1 the optimizer state split over the ranks (data_parallel.py `TrainerGroup`). A
state_dict() under ZeRO stage 1 holds the optimizer state of this rank's part.

`options['graph_transformer']['transformer_layer_recompute']` recomputes each of the model's
repeated layers (export/checkpoints.py `repeated_layers`; the first `number_recompute_layers`,
0: all) in the backward pass: they are exported as if run under torch.utils.checkpoint.

`register_train_step_hook(fn)` calls `fn(trainer, loss, inputs)` after every `train_step` (the
step boundary `%%ort` records), and inside `pytorch_baseline()` train_step runs the forward and
backward in PyTorch eager with the same update: the baseline half of `%%ort compare`."""
from __future__ import annotations

import inspect

import onnx
import torch

from ortrain import _ortrain
from ortrain import optim as _optim
from ortrain import data_parallel, trainer_options
from ortrain._trainer_hooks import in_pytorch_baseline, pytorch_baseline, register_train_step_hook, run_step_hooks  # noqa: F401 (public here too)
from ortrain._steps import loss_kind
from ortrain.engine.function import grad_addresses, read_outputs, run_inference
from ortrain.engine.model_loss import loss_is_cross_entropy
from ortrain.engine.tensors import triple
from ortrain.export import checkpoints


def _check_model_desc(desc) -> dict:
    if not isinstance(desc, dict) or set(desc) - {"inputs", "outputs"} or "inputs" not in desc or "outputs" not in desc:
        raise ValueError("model_desc must be {'inputs': [(name, shape)], 'outputs': [(name, shape[, is_loss])]}")
    for i, item in enumerate(desc["inputs"]):
        if not (isinstance(item, (tuple, list)) and len(item) == 2 and isinstance(item[0], str)):
            raise ValueError(f"model_desc['inputs'][{i}] must be (name, shape), got {item!r}")
    losses = [o for o in desc["outputs"] if len(o) > 2 and o[2]]
    if len(losses) > 1:
        raise ValueError("model_desc['outputs'] marks more than one output as the loss")
    return desc




def _release_from_accelerate(model) -> None:
    """The trainer runs model + loss as one engine graph of its own: a module that
    `accelerate()` (or `%%ort`) took over is given back to plain PyTorch before it is exported."""
    import ortrain  # through the package's lazy names: importing the submodule here would
    # shadow the public function `ortrain.accelerate` with the module `ortrain.accelerate`

    if ortrain.is_accelerated(model):
        ortrain.deaccelerate(model)


class _WithLoss(torch.nn.Module):
    """model + loss_fn as one module: forward(*inputs) -> (loss, *model outputs)."""

    def __init__(self, model, loss_fn, n_model_inputs):
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn
        self.n = n_model_inputs

    def forward(self, *inputs):
        out = self.model(*inputs[: self.n])
        loss = self.loss_fn(out, *inputs[self.n:])
        outs = out if isinstance(out, tuple) else (out,)
        return (loss,) + tuple(outs)


def _n_forward_args(model) -> int:
    """The model takes its required positional arguments; the remaining inputs go to loss_fn."""
    params = inspect.signature(model.forward).parameters.values()
    return sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty for p in params)


class ORTTrainer:
    def __init__(self, model: torch.nn.Module, model_desc: dict, optim_config, loss_fn=None, options: dict | None = None):
        if not isinstance(optim_config, (_optim.SGDConfig, _optim.AdamConfig, _optim.LambConfig)):
            raise TypeError("optim_config must be ortrain.optim.SGDConfig, AdamConfig or LambConfig")
        optim_config.validate()
        _release_from_accelerate(model)
        self.model = model
        self.model_desc = _check_model_desc(model_desc)
        self.optim_config = optim_config
        self.options = trainer_options.validate(options)
        self.loss_fn = loss_fn
        if loss_fn is None and not any(len(o) > 2 and o[2] for o in model_desc["outputs"]):
            raise ValueError("without loss_fn, model_desc must mark one output as the loss: (name, shape, True)")
        frozen = set(self.options["utils"]["frozen_weights"])
        unknown = frozen - {n for n, _ in model.named_parameters()}
        if unknown:
            raise ValueError(f"options['utils']['frozen_weights'] names unknown parameters: {sorted(unknown)}")
        for n, p in model.named_parameters():
            if n in frozen:
                p.requires_grad_(False)
        # data parallel: every rank starts from rank 0's weights; gradients averaged over ranks
        self._group = data_parallel.TrainerGroup.from_options(self.options["distributed"])
        if self._group is not None:
            self._group.broadcast(list(model.parameters()) + list(model.buffers()))
        self._recomputed_layers()  # a bad graph_transformer option fails here, not at the first step
        self._module = _WithLoss(model, loss_fn, _n_forward_args(model)) if loss_fn else model
        self._prefix = "model." if loss_fn else ""
        self._loss_index = 0 if loss_fn else next(i for i, o in enumerate(model_desc["outputs"]) if len(o) > 2 and o[2])
        self._runners: dict = {}
        self._loss_kinds: dict = {}  # runner key -> loss kind (ONNX op producing the loss) or None
        self._last_loss_kind = None
        self._last_train = None  # (runner, inputs) of the last engine train_step, for summary()
        self._state: dict = {}  # parameter name -> {"exp_avg", "exp_avg_sq"} or {"momentum_buffer"}
        self._accum: dict = {}
        self.step = 0  # optimizer steps taken
        self._micro = 0

    # ----------------------------------------------------------------------------- plumbing
    def _runner(self, inputs: tuple, training: bool):
        from ortrain.engine.runner import Runner
        from ortrain.export import export_cached, signature

        key = (signature(inputs), training)
        if key not in self._runners:
            _release_from_accelerate(self.model)
            self._module.train(training)
            with checkpoints.checkpointed_forwards(self._recomputed_layers() if training else []):
                exported = export_cached(self._module, inputs, training=training)
            mp = self.options["mixed_precision"]
            self._runners[key] = Runner(self._module, exported, mp["dtype"] if mp["enabled"] else "fp32")
        return self._runners[key]

    def _recomputed_layers(self) -> list:
        """The layers options['graph_transformer'] asks to recompute in the backward pass."""
        opts = self.options["graph_transformer"]
        if not opts["transformer_layer_recompute"]:
            return []
        layers = checkpoints.repeated_layers(self.model)
        if not layers:
            raise ValueError(f"options['graph_transformer']['transformer_layer_recompute']: {type(self.model).__name__} "
                             "has no layers to recompute (no ModuleList or Sequential of two or more modules of "
                             "one class)")
        n = opts["number_recompute_layers"]
        return [m for _, m in (layers[:n] if n else layers)]

    def loss_kind(self) -> str | None:
        """What produced the loss: "CrossEntropyLoss" / "NllLoss" when it is such an op in the
        exported train graph (also inside a user's loss_fn), the grad_fn's name in a PyTorch
        baseline step; None before the first train_step or for other losses."""
        return self._last_loss_kind

    def summary(self) -> str:
        """One line: what this trainer ran in the engine (exporter, graph, planned arena)."""
        head = (f"ORTTrainer: forward, loss, backward and the {type(self.optim_config).__name__[:-6]} update of "
                f"{type(self.model).__name__} in the engine")
        if self._last_train is None:
            return head + " (no train_step in the engine yet)"
        runner, inputs = self._last_train
        e = runner.exported
        fwd, bwd = runner.session.node_count
        info = runner.plan_info(list(inputs), True)
        shapes = ", ".join(str(list(x.shape)) for x in inputs)
        recomputed = dict(runner.session.passes).get("recompute_segments", 0)
        again = f", {recomputed} layer(s) recomputed in the backward pass" if recomputed else ""
        return (f"{head}; exporter {e.exporter} (opset {e.opset}, {e.seconds:.2f} s), {fwd} forward + {bwd} gradient "
                f"nodes{again}; plan for inputs {shapes}: peak arena {info['arena_bytes'] / 2**20:.1f} MiB")

    def _find_loss_kind(self, key, runner) -> str | None:
        if key in self._loss_kinds:
            return self._loss_kinds[key]
        graph = onnx.load_from_string(runner.exported.onnx_bytes).graph
        loss = graph.output[self._loss_index].name
        # the kind `%%ort` logs perplexity for, as it would for PyTorch's loss
        self._loss_kinds[key] = "CrossEntropyLoss" if loss_is_cross_entropy(graph, loss, runner.exported.param_map) else None
        return self._loss_kinds[key]

    def _param_name(self, onnx_name: str, runner) -> str:
        key = runner.exported.param_map[onnx_name]
        return key[len(self._prefix):] if key.startswith(self._prefix) else key

    def _lr(self) -> float:
        sched = self.options["lr_scheduler"]
        return self.optim_config.lr * (sched.factor(self.step) if sched else 1.0)

    # ----------------------------------------------------------------------------- API
    def train_step(self, *inputs):
        """Forward, loss, backward and (every gradient_accumulation_steps calls) the update."""
        inputs = tuple(x.contiguous() for x in inputs)
        if in_pytorch_baseline():
            result = self._train_step_pytorch(inputs)
        else:
            result = self._train_step_engine(inputs)
        loss = result[0] if isinstance(result, tuple) else result
        run_step_hooks(self, loss, inputs)
        return result

    def _train_step_engine(self, inputs: tuple):
        from ortrain.export import signature

        key = (signature(inputs), True)
        runner = self._runner(inputs, True)
        self._last_loss_kind = self._find_loss_kind(key, runner)
        self._last_train = (runner, inputs)
        session = runner.session
        # the gradient tensors are bound from the forward pass on: gradients the graph makes in
        # the forward pass (the fused LM head + loss) are written straight into them
        grads = runner.new_grad_buffers()
        grad_addrs = grad_addresses(grads)
        pending = session.forward([triple(x, n) for x, n in zip(inputs, runner.input_names)],
                                  runner.weight_addresses(), True, int(torch.randint(0, 2**62, (1,)).item()),
                                  None, grad_addrs)
        outs = read_outputs(pending, runner.n_outputs)
        seeds = [torch.ones_like(o) if k == self._loss_index else torch.zeros_like(o) if o.is_floating_point() else None
                 for k, o in enumerate(outs)]
        session.backward(pending, runner.weight_addresses(), [0 if s is None else s.data_ptr() for s in seeds], grad_addrs)
        named = [(self._param_name(n, runner), w, g) for n, w, g in zip(session.weight_names, runner.weights, grads) if g is not None]
        self._accumulate(named)
        return self._result(outs)

    def _train_step_pytorch(self, inputs: tuple):
        """The same step with PyTorch eager forward and backward (see `pytorch_baseline`)."""
        self._module.train(True)
        with torch.enable_grad():
            outs = self._module(*inputs)
            outs = tuple(outs) if isinstance(outs, (tuple, list)) else (outs,)
            params = [(n, p) for n, p in self._module.named_parameters() if p.requires_grad]
            grads = torch.autograd.grad(outs[self._loss_index], [p for _, p in params], allow_unused=True)
        prefix = len(self._prefix)
        named = [(n[prefix:] if n.startswith(self._prefix) else n, p.detach(), g) for (n, p), g in zip(params, grads) if g is not None]
        self._accumulate(named)
        self._last_loss_kind = loss_kind(outs[self._loss_index])
        return self._result(tuple(o.detach() for o in outs))

    def _accumulate(self, named: list) -> None:
        accum = self.options["batch"]["gradient_accumulation_steps"]
        group = self._group
        if group is not None and not (group.post_accumulation and accum > 1):
            group.average([g for _, _, g in named])
        for name, _, g in named:
            if name in self._accum:
                self._accum[name].add_(g)
            else:
                self._accum[name] = g
        self._micro += 1
        if self._micro % accum == 0:
            if group is not None and group.post_accumulation and accum > 1:
                group.average([self._accum[n] for n, _, _ in named])
            self._update([(n, w, self._accum[n].div_(accum) if accum > 1 else self._accum[n]) for n, w, _ in named])
            self._accum = {}

    def _result(self, outs: tuple):
        loss = outs[self._loss_index]
        rest = [o for k, o in enumerate(outs) if k != self._loss_index]
        return loss if not rest else (loss, *rest)

    def _update(self, named: list):
        clip = self.options["utils"]["grad_norm_clip"]
        if clip:
            max_norm = 1.0 if clip is True else float(clip)
            total = _ortrain.global_norm([(g.data_ptr(), g.numel()) for _, _, g in named])
            if total > max_norm:
                _ortrain.scale([(g.data_ptr(), g.numel()) for _, _, g in named], max_norm / (total + 1e-6))
        self.step += 1
        lr_factor = self._lr() / self.optim_config.lr
        cfg = self.optim_config
        group = self._group
        everyone = named
        if group is not None and group.zero_stage == 1:
            owners = group.owners([(n, w) for n, w, _ in named])
            named = [t for t, o in zip(named, owners) if o == group.rank]
        for name, w, g in named:
            hp = cfg.for_param(name)
            st = self._state.setdefault(name, {})
            if isinstance(cfg, _optim.SGDConfig):
                first = "momentum_buffer" not in st and hp["momentum"] != 0
                if hp["momentum"] != 0 and first:
                    st["momentum_buffer"] = torch.empty_like(w)
                buf = st.get("momentum_buffer")
                _ortrain.sgd_step([(w.data_ptr(), g.data_ptr(), 0 if buf is None else buf.data_ptr(), w.numel(), first)],
                                  hp["lr"] * lr_factor, hp["momentum"], hp["dampening"], hp["weight_decay"], hp["nesterov"], False)
                continue
            if not st:
                st["exp_avg"] = torch.zeros_like(w)
                st["exp_avg_sq"] = torch.zeros_like(w)
            t = [(w.data_ptr(), g.data_ptr(), st["exp_avg"].data_ptr(), st["exp_avg_sq"].data_ptr(), w.numel(), self.step)]
            if isinstance(cfg, _optim.AdamConfig):
                _ortrain.adam_step(t, hp["lr"] * lr_factor, hp["alpha"], hp["beta"], hp["epsilon"], hp["lambda_coef"],
                                   hp["decoupled_weight_decay"], False)
            else:
                _ortrain.lamb_step(t, hp["lr"] * lr_factor, hp["alpha"], hp["beta"], hp["epsilon"], hp["lambda_coef"],
                                   hp["do_bias_correction"], hp["ratio_min"], hp["ratio_max"])
        if group is not None and group.zero_stage == 1:
            group.share_updates([(n, w) for n, w, _ in everyone])

    def eval_step(self, *inputs):
        """Forward (with the loss, if loss_fn was given) in eval mode; no update."""
        inputs = tuple(x.contiguous() for x in inputs)
        runner = self._runner(inputs, False)
        outs = run_inference(runner, list(inputs))
        return outs[0] if len(outs) == 1 else tuple(outs)

    def save_as_onnx(self, path: str, *example_inputs):
        """Writes the model (with loss, if any) as ONNX with the current trained weights."""
        if not self._runners and not example_inputs:
            raise ValueError("save_as_onnx needs example inputs before the first train_step/eval_step")
        runner = next(iter(self._runners.values())) if self._runners else self._runner(tuple(example_inputs), False)
        model = onnx.load_from_string(runner.exported.onnx_bytes)
        live = dict(zip(runner.session.weight_names, runner.weights))
        for init in model.graph.initializer:
            if init.name in live:
                init.CopyFrom(onnx.numpy_helper.from_array(live[init.name].detach().numpy(), init.name))
        onnx.save(model, path)

    def state_dict(self) -> dict:
        return {"model": self.model.state_dict(),
                "optimizer": {"step": self.step, "state": {k: {n: t.clone() for n, t in v.items()} for k, v in self._state.items()}}}

    def load_state_dict(self, state: dict, strict: bool = True):
        if set(state) != {"model", "optimizer"}:
            raise ValueError("state_dict must have the keys 'model' and 'optimizer' (from ORTTrainer.state_dict())")
        with torch.no_grad():
            self.model.load_state_dict(state["model"], strict=strict)
        self.step = int(state["optimizer"]["step"])
        self._state = {k: {n: t.clone() for n, t in v.items()} for k, v in state["optimizer"]["state"].items()}

