"""`ortrain.accelerate(model, optimizer)`: the module's forward and backward run in the engine,
the optimizer's step too. The module is patched in place (every reference to it is accelerated),
its parameters stay its own (the engine reads and writes their memory), and its state_dict keys
do not change. Whatever the engine cannot take runs in PyTorch, with one warning naming why."""
from __future__ import annotations

import functools
from contextlib import contextmanager, nullcontext

import torch

from ortrain import fully_sharded
from ortrain._loss_calls import LossCalls
from ortrain._warn import first_line, warn
from ortrain.errors import OrtrainError

_VALID_DEVICES = ("cpu", "cuda")
_VALID_PRECISIONS = ("fp32", "bf16", "fp16")


#: bumped whenever any module registers a parameter or a submodule (torch's global registration
#: hooks, installed on the first accelerate()): the per-model parameter lists below are cached
#: between such events (module.parameters() walks every submodule: ~50 us per call on the
#: tutorial model, in every forward)
_REGISTRATIONS = [0]
_HOOKS: list = []


def _count_registration(*_):
    _REGISTRATIONS[0] += 1  # returns None: the registered object is kept as is


def _watch_registrations() -> None:
    if not _HOOKS:
        from torch.nn.modules import module as torch_module

        _HOOKS.append(torch_module.register_module_parameter_registration_hook(_count_registration))
        _HOOKS.append(torch_module.register_module_module_registration_hook(_count_registration))


class _State(LossCalls):
    """Per-module acceleration state: exports and runners cached per call signature and mode."""

    def __init__(self, module, optimizer, device, strict, exporter, fuse_loss=True, dynamic="auto"):
        self.module = module
        self.optimizer = optimizer
        self.device = device
        self.strict = strict
        self.exporter = exporter
        # (signature, training, (parameter, trains) pairs[, input sizes]) -> Runner | Exception: the sizes
        # are in the key of graphs exported with fixed sizes
        self.runners: dict = {}
        self.dynamic = dynamic  # "auto" | True | False (accelerate's `dynamic`)
        self.any_sizes: dict = {}  # (signature, training, mask) -> whether its graph takes any sizes
        self.last_key = None
        self.last_inputs = None
        self.calls = 0
        self.engine_calls = 0
        self.optimizer_in_engine = False
        self.fuse_loss = fuse_loss
        # (runner key, slices, classes, ignore_index, reduction) or (runner key, "model loss") ->
        # runner | Exception | None (a model loss graph that would not fuse the LM head)
        self.loss_runners: dict = {}
        self.fused_loss_calls = 0
        self.model_loss_calls = 0  # calls whose own loss ran alone, the logits lazy (model_loss.py)
        self.logits_read: set = set()  # loss_runners keys of model losses whose logits the user read
        self.precision = "fp32"
        self.loss_scale_mode = None  # accelerate's `loss_scale`: None (dynamic for fp16) | "dynamic" | False
        self.loss_scaler = None  # engine/loss_scale.py's DynamicLossScaler while scaling is on
        self.cuda_graphs = True  # accelerate's `cuda_graphs`
        self.setup_bytes = None  # resident size that exporting and building the runners added
        self._params: tuple = (-1, [])  # (registration count, module.parameters()) when listed
        self.warned_autocast = False  # autocast_covered's warning was given
        self.optimizer_taken_at_step = False  # made after accelerate(), taken at its first step (late_optimizer.py)

    def adopt(self, runner):
        """A new runner (or the exception that prevented it), given the loss scaler and, on CUDA,
        its graph cache (engine/cuda_graphs.py) while `cuda_graphs` is on."""
        if runner is not None and not isinstance(runner, Exception):
            runner.loss_scaler = self.loss_scaler
            # FSDP2 gathers the parameters into fresh memory every step: no graph replays them
            on_cuda = getattr(runner, "on_cuda", False)
            if not (self.cuda_graphs and on_cuda) or fully_sharded.is_sharded_root(self.module):
                runner.graphs = None
            elif getattr(runner, "graphs", None) is None:
                from ortrain.engine.cuda_graphs import GraphCache, enabled_by_environment

                runner.graphs = GraphCache(runner.device) if enabled_by_environment() else None
        return runner

    def set_cuda_graphs(self, on: bool) -> None:
        self.cuda_graphs = on
        for r in (*self.runners.values(), *self.loss_runners.values()):
            self.adopt(r)

    def set_loss_scaler(self, scaler) -> None:
        self.loss_scaler = scaler
        for r in (*self.runners.values(), *self.loss_runners.values()):
            self.adopt(r)

    def parameters(self) -> list:
        """module.parameters(), listed again only after a parameter or submodule was registered
        (and at every call under FSDP2, which swaps shards and whole tensors without registering)."""
        if self._params[0] != _REGISTRATIONS[0] or fully_sharded.is_sharded_root(self.module):
            self._params = (_REGISTRATIONS[0], list(self.module.parameters()))
        return self._params[1]

    @contextmanager
    def counting_setup(self):
        """Adds what the body adds to the resident size to `setup_bytes` (explain()'s memory
        estimate); nothing when the body raises."""
        from ortrain._memory import rss_bytes

        before = rss_bytes()
        yield
        after = rss_bytes()
        if before is not None and after is not None:
            self.setup_bytes = (self.setup_bytes or 0) + after - before

    @contextmanager
    def plain(self):
        """The module's own forward, for exporting and fallback."""
        patched = self.module.__dict__.pop("forward", None)
        try:
            yield
        finally:
            if patched is not None:
                self.module.__dict__["forward"] = patched

    def runner_for(self, args, kwargs):
        """The runner of this call: exported (and built) on the first call of its kind.

        `dynamic="auto"` (accelerate's default) exports the first call with its input sizes fixed
        (a trace without symbolic sizes: 1.1 instead of 1.9 s for the tutorial model) and, on the
        first call of the same kind with other sizes, once more with every size symbolic; that
        graph then serves every size. A model that cannot be exported with symbolic sizes gets
        one fixed-size graph per distinct set of sizes instead."""
        from ortrain.export import signature, sizes

        # which tensors the graph binds (a layer replaced after accelerate() brings new ones) and
        # which of them train
        mask = tuple((id(p), p.requires_grad) for p in self.parameters())
        # a call under an autocast the session does not cover exports another graph (its casts)
        base = ((signature(args, kwargs), self._autocast_dtype()), self.module.training, mask)
        fixed = base + (sizes(args, kwargs),)
        key = base if self.any_sizes.get(base, self.dynamic is True) else fixed
        if key not in self.runners:
            earlier = [r for k, r in self.runners.items() if k[:3] == base]
            failed = next((r for r in earlier if isinstance(r, Exception)), None)
            if failed is not None:
                # this kind of call already failed to export: PyTorch runs it at any size
                self.runners[key] = failed
            else:
                key, runner = self._new_runner(args, kwargs, base, fixed, switch=bool(earlier))
                self.runners[key] = runner
        self.last_key = key
        return self.runners[key]

    def _new_runner(self, args, kwargs, base, fixed, switch: bool):
        """(key, runner) of a call whose graph does not exist yet: key `base` for a graph of any
        sizes, `fixed` for one of these sizes; `switch`: other sizes of this kind of call were
        exported with fixed sizes before."""
        dynamic = self.dynamic is True or (switch and self.dynamic == "auto" and base not in self.any_sizes)
        with self.counting_setup():
            runner = self._export_and_build(args, kwargs, dynamic=dynamic)
            if isinstance(runner, Exception) and dynamic and self.dynamic == "auto":
                # no graph with symbolic sizes: one graph per set of sizes
                runner = self._export_and_build(args, kwargs, dynamic=False)
                dynamic = False
        if self.dynamic == "auto" and switch:
            self.any_sizes[base] = dynamic
        if dynamic:
            self._forget_fixed(base)
        if isinstance(runner, Exception):
            self._fall_back(runner)
        return (base if dynamic else fixed), runner

    def _export_and_build(self, args, kwargs, dynamic: bool):
        """A Runner for this call's graph, or the exception that prevented it."""
        from ortrain.export import export_cached
        from ortrain.engine.model_loss import autograd_function
        from ortrain.engine.runner import Runner

        try:
            fully_sharded.check_bindable(self.module)
            with self.plain(), fully_sharded.hooks_off(self.module):
                exported = export_cached(self.module, args, kwargs, training=self.module.training,
                                         exporter=self.exporter, dynamic=dynamic)
            runner = Runner(self.module, exported, self.precision, self.device)
            runner.function = autograd_function(runner.exported)
            return self.adopt(runner)
        except Exception as exc:  # noqa: BLE001 - reported by the caller, then PyTorch runs the call
            return exc

    def _forget_fixed(self, base) -> None:
        """Drops the fixed-size runners of `base` (and the loss runners built on them): its graph
        for any size replaces them."""
        stale = [k for k in self.runners if len(k) == 4 and k[:3] == base]
        for k in stale:
            del self.runners[k]
        for k in [k for k in self.loss_runners if k[0] in stale]:
            del self.loss_runners[k]

    def _fall_back(self, exc: Exception):
        if self.strict:
            raise OrtrainError(f"ortrain (strict): {type(self.module).__name__} cannot run in the engine: {exc}") from exc
        warn(f"ortrain: {type(self.module).__name__} runs in PyTorch: {first_line(exc)}")

    def _autocast_dtype(self):
        """The dtype of a `torch.autocast` enabled around this call for the session's device
        type, or None."""
        kind = "cuda" if self.device == "cuda" else "cpu"
        return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else None

    def autocast_covered(self):
        """A user's `torch.autocast` around the call. Of the session's own 16-bit type (bf16 with
        precision="bf16", fp16 with "fp16"), it asks for what the session's matmuls already do:
        the context returned turns it off for the export and the engine, which then run the
        graph they run without it (f32 outputs). Any other is exported into the graph (its
        casts), with one warning saying how to get the faster graph; nullcontext then."""
        dtype = self._autocast_dtype()
        if dtype is None:
            return nullcontext()
        kind = "cuda" if self.device == "cuda" else "cpu"
        if (self.precision, dtype) in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
            return torch.autocast(kind, enabled=False)
        if not self.warned_autocast:
            self.warned_autocast = True
            name = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype)
            faster = (f"ortrain.accelerate(model, optimizer, precision='{name}') without the autocast runs the same "
                      f"matmul precision on the session's faster graph" if name else "")
            warn(f"ortrain: {type(self.module).__name__} runs under torch.autocast({kind}, {str(dtype).replace('torch.', '')}): "
                 f"its casts are exported into the engine graph" + (f"; {faster}" if faster else ""))
        return nullcontext()

    def forward(self, *args, **kwargs):
        self.calls += 1
        with self.autocast_covered():
            return self._forward(args, kwargs)

    def _forward(self, args, kwargs):
        from ortrain.export import flat_tensors, unflatten_outputs
        from ortrain.engine.runner import Runner

        sharded = fully_sharded.is_sharded_root(self.module)
        if sharded:
            fully_sharded.gather(self.module)
        runner = self.runner_for(args, kwargs)
        if not isinstance(runner, Runner):
            with self.plain():
                return self.module.forward(*args, **kwargs)
        flat = flat_tensors(args, kwargs)
        self.last_inputs = flat
        lazy = self._deferred(runner, flat, args, kwargs)
        if lazy is not None:
            return lazy
        try:
            outs = runner(flat, torch.is_grad_enabled())
        except Exception as exc:  # noqa: BLE001
            from ortrain._ortrain import EngineError

            if not isinstance(exc, (EngineError, OrtrainError)):
                raise
            self.runners[self.last_key] = exc
            self._fall_back(exc)
            with self.plain():
                return self.module.forward(*args, **kwargs)
        self.engine_calls += 1
        if sharded and not (torch.is_grad_enabled() and runner.trainable_params):
            fully_sharded.release(self.module)
        return unflatten_outputs(runner.exported.output_structure, outs)


def accelerate(model: torch.nn.Module, optimizer=None, *, device: str | None = None, strict: bool = False,
               exporter: str = "auto", fuse_loss: bool = True, precision: str | None = None,
               dynamic: bool | str | None = None, loss_scale: str | bool | None = None,
               cuda_graphs: bool | None = None):
    """Runs `model`'s forward and backward (and `optimizer.step()`) in the ortrain engine.

    The module is changed in place and returned. Inside a DistributedDataParallel (or a
    one-device DataParallel) the wrapped module is the one taken over, before or after the
    wrapper is made, so that the wrapper still all-reduces the gradients. Without `optimizer`, a
    torch Adam, AdamW or SGD made later over the model's parameters (Hugging Face's Trainer makes
    its AdamW inside `train()`) is taken into the engine at its first step (late_optimizer.py).
    `strict=True` turns every fallback to PyTorch into an error. `exporter`: "auto" | "dynamo" | "legacy". `fuse_loss`: in training, the
    output is returned lazily so that `F.cross_entropy` / `nn.CrossEntropyLoss` on it runs inside
    the engine with the model (the logits and their gradient never pass through PyTorch); any
    other use of the output computes it as usual. `precision`: "fp32", or "bf16" for mixed
    precision like `torch.autocast("cpu", torch.bfloat16)` for matmuls: every matmul (forward and
    backward) multiplies bf16-rounded operands with f32 accumulation, while weights, activations,
    gradients and the optimizer stay f32. On a CPU it needs avx512_bf16 or AMX (elsewhere it runs
    fp32); on CUDA each f32 matmul rounds its operands to bf16 and runs on bf16 tensor cores
    with an f32 result. "fp16" (CUDA only): the same at fp16, with the dynamic loss scaler. `explain()` says which matmul path runs.
    None (the default) keeps what an earlier call set ("fp32" at first). `device="cuda"`: the
    model's parameters on one GPU (any `cuda:N`); the engine runs on PyTorch's current stream
    of that GPU. None (the
    default) is "cpu" for a model not yet accelerated and the model's device otherwise; another
    device than the model's is an error (deaccelerate it first).
    `dynamic`: the input sizes the exported graph takes. "auto" exports the first call with its
    sizes fixed (the faster export) and, the first time the sizes change, once more for any
    sizes (as torch.compile's automatic dynamic shapes); True: any sizes from the first call
    (for inputs whose sizes change every step); False: one graph per distinct set of sizes.
    None keeps what an earlier call set ("auto" at first).
    `loss_scale`: "dynamic" multiplies the gradient entering the engine's backward pass by a scale
    and divides the weight gradients by it again before they reach `.grad` (so `.grad`, clipping
    and the optimizer see true gradients); `optimizer.step()` is skipped after any inf/NaN
    gradient, the scale halving then and doubling after 2000 finite steps (start 2^16), as ONNX
    Runtime's mixed precision did. It needs the optimizer. None (the default): "dynamic" with
    precision="fp16", off otherwise; False turns it off. `ortrain.loss_scale(model)` reports it.
    `cuda_graphs` (CUDA): from the second step of each input shape on, the forward and the
    backward pass each replay one recorded CUDA graph instead of launching their kernels one by
    one (a small model's step is bound by those launches); dropout masks, gradients and
    losses are the same as without. Steps that cannot use a graph (gradient accumulation
    without `zero_grad()`, two forward passes before one backward) run without one. None (the
    default) keeps what an earlier call set (on at first); `ORTRAIN_CUDA_GRAPHS=0` turns them
    off for the process. `explain()` says what was recorded.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"accelerate() takes an nn.Module, got {type(model).__name__}")
    from ortrain import data_parallel

    wrapper, model = model, data_parallel.to_accelerate(model)
    state = getattr(model, "_ortrain_state", None)
    if device is None:
        device = state.device if state is not None else "cpu"
    elif device not in _VALID_DEVICES:
        raise ValueError(f"device={device!r} is not one of {', '.join(_VALID_DEVICES)}")
    if state is not None and state.device != device:
        raise OrtrainError(f"device={device!r}: the model is already accelerated on {state.device!r}; "
                           "call ortrain.deaccelerate(model) first, then accelerate it on the other device")
    if device == "cuda":
        from ortrain.cuda import cuda_available, unavailable_message

        if not torch.cuda.is_available():
            if not cuda_available(0)[0]:  # no driver or no GPU: the reason, before PyTorch's view
                raise OrtrainError(unavailable_message("device='cuda'"))
            raise OrtrainError("device='cuda': PyTorch sees no CUDA device (torch.cuda.is_available() is False)")
        from ortrain.engine.cuda_device import model_gpu

        gpu = model_gpu(model)  # one GPU holds the whole model; only its runtime is made
        if not cuda_available(gpu.index)[0]:
            raise OrtrainError(unavailable_message(f"device='cuda' ({gpu})", gpu.index))
    if exporter not in ("auto", "dynamo", "legacy"):
        raise ValueError(f"exporter={exporter!r} is not one of auto, dynamo, legacy")
    if precision is not None and precision not in _VALID_PRECISIONS:
        raise ValueError(f"precision={precision!r} is not one of {', '.join(_VALID_PRECISIONS)}")
    if dynamic is not None and not (isinstance(dynamic, bool) or dynamic == "auto"):
        raise ValueError(f"dynamic={dynamic!r} is not one of 'auto', True, False")
    if loss_scale is not None and loss_scale is not False and loss_scale != "dynamic":
        raise ValueError(f"loss_scale={loss_scale!r} is not one of 'dynamic', False, None")
    if cuda_graphs is not None and not isinstance(cuda_graphs, bool):
        raise ValueError(f"cuda_graphs={cuda_graphs!r} is not one of True, False, None")
    _check_mixed_precision(model, optimizer, device, precision, loss_scale)
    _watch_registrations()
    if state is None:
        state = _State(model, optimizer, device, strict, exporter, fuse_loss, "auto" if dynamic is None else dynamic)
        model.__dict__["_ortrain_state"] = state
        model.__dict__["forward"] = _engine_forward(state, model)
    if precision is not None and state.precision != precision:
        state.precision = precision
        state.runners.clear()  # sessions are built for one precision
        state.loss_runners.clear()
    if dynamic is not None and state.dynamic != dynamic:
        state.dynamic = dynamic  # graphs are exported for the sizes this asks for
        state.any_sizes.clear()
        state.runners.clear()
        state.loss_runners.clear()
    from ortrain.engine import clip

    clip.install(model)  # clip_grad_norm_ of its gradients runs in the engine (CPU or GPU)
    if optimizer is not None:
        from ortrain.engine.optimizer import accelerate_optimizer

        if state.optimizer is not None and state.optimizer is not optimizer:
            from ortrain.engine.loss_scale import unguard

            unguard(state.optimizer)  # the scaler guards the new one below
        state.optimizer = optimizer
        # on CUDA the engine has Adam/AdamW (one multi-tensor launch); SGD stays PyTorch's there
        engine_has_it = device == "cpu" or isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW))
        state.optimizer_in_engine = accelerate_optimizer(optimizer, strict) if engine_has_it else False
    elif state.optimizer is None:
        from ortrain import late_optimizer

        late_optimizer.wait_for_optimizer(state)  # one made later (HF's Trainer) is taken at its first step
    if loss_scale is not None:
        state.loss_scale_mode = loss_scale
    _apply_loss_scale(state)
    if cuda_graphs is not None and cuda_graphs != state.cuda_graphs:
        state.set_cuda_graphs(cuda_graphs)
    return wrapper


def _engine_forward(state, module):
    """The accelerated module's `forward`: the engine's, with the name, docstring and signature
    of the module's own (functools.wraps). Code that inspects `model.forward` sees the model's
    parameters: Hugging Face's Trainer keeps only the dataset columns they name (and dropped
    `input_ids` when it saw `*args, **kwargs`)."""
    own = module.forward

    @functools.wraps(own)
    def forward(*args, **kwargs):
        return state.forward(*args, **kwargs)

    return forward


def _check_mixed_precision(model, optimizer, device, precision, loss_scale) -> None:
    """Refuses fp16 off CUDA and loss scaling without an optimizer before anything changes."""
    from ortrain import data_parallel

    state = data_parallel.unwrap(model).__dict__.get("_ortrain_state")
    device = state.device if state is not None else device
    precision = precision if precision is not None else (state.precision if state is not None else "fp32")
    if precision == "fp16" and device != "cuda":
        raise ValueError("precision='fp16' needs device='cuda' (fp16 matmuls run on cuBLAS); on the CPU use "
                         "precision='bf16'")
    mode = loss_scale if loss_scale is not None else (state.loss_scale_mode if state is not None else None)
    if _scales(mode, precision) and optimizer is None and (state is None or state.optimizer is None):
        raise ValueError("loss scaling (precision='fp16' or loss_scale='dynamic') needs the optimizer: "
                         "accelerate(model, optimizer, ...), so that steps with inf/NaN gradients are skipped")


def _scales(mode, precision: str) -> bool:
    """Whether accelerate's `loss_scale` mode (None: dynamic for fp16) turns the scaler on."""
    return mode == "dynamic" or (mode is None and precision == "fp16")


def _apply_loss_scale(state) -> None:
    """Turns the dynamic loss scaler on or off as `state` asks (fp16: on unless turned off)."""
    from ortrain.engine import loss_scale as ls

    if not _scales(state.loss_scale_mode, state.precision):
        if state.loss_scaler is not None:
            if state.optimizer is not None:
                ls.unguard(state.optimizer)
            state.set_loss_scaler(None)
        return
    scaler = state.loss_scaler
    if scaler is None:
        from ortrain.engine.cuda_device import model_gpu

        device = model_gpu(state.module) if state.device == "cuda" else torch.device("cpu")
        scaler = ls.DynamicLossScaler(device)
    ls.guard(state.optimizer, scaler)
    state.set_loss_scaler(scaler)


def loss_scale(model) -> dict | None:
    """The dynamic loss scaler's state of an accelerated model (scale, steps, skipped_steps,
    growth_interval), or None where loss scaling is off."""
    state = _state_of(model)
    scaler = getattr(state, "loss_scaler", None)
    return None if scaler is None else scaler.state()


def deaccelerate(model: torch.nn.Module):
    """Restores plain PyTorch (same parameters, same optimizer state)."""
    from ortrain import data_parallel

    wrapper, model = model, data_parallel.unwrap(model)
    state = model.__dict__.pop("_ortrain_state", None)
    model.__dict__.pop("forward", None)
    from ortrain import late_optimizer

    late_optimizer.forget(state)
    from ortrain.engine import clip

    clip.forget(model)
    if state is not None and state.optimizer is not None:
        from ortrain.engine.loss_scale import unguard
        from ortrain.engine.optimizer import restore_optimizer

        unguard(state.optimizer)
        restore_optimizer(state.optimizer)
    return wrapper


def is_accelerated(model) -> bool:
    return isinstance(_state_of(model), _State)


def _state_of(model):
    """The acceleration state of `model`, or of the module a data-parallel wrapper holds (None
    when not accelerated)."""
    from ortrain import data_parallel

    if not isinstance(model, torch.nn.Module):
        return None
    return data_parallel.unwrap(model).__dict__.get("_ortrain_state")
