"""A Runner binds one exported graph to a module's live parameters and buffers: it builds the
engine session (weights named by their ONNX initializer names, bound to the torch tensors'
memory on every call, so nothing is copied per step) and runs calls through it."""
from __future__ import annotations

import dataclasses
import sys

import onnx
import torch

from ortrain import _ortrain, fully_sharded
from ortrain.errors import OrtrainError, UnsupportedError
from ortrain.export.graph import strip_bound_weights

from . import malloc
from .cuda_device import model_gpu
from .function import EngineFunction, run_inference
from .tensors import check_addressable, engine_dtype


def _with_buffer_outputs(exported) -> tuple[bytes, list]:
    """Adds the updated BatchNorm statistics as graph outputs; returns (bytes, [(key, output)]).

    PyTorch updates running_var with the unbiased batch variance, ONNX's BatchNormalization with
    the biased one: training-mode BatchNormalization nodes get the engine's extension attribute
    `unbiased_running_var=1` so that the running statistics match PyTorch's."""
    if not exported.buffer_updates:
        return exported.onnx_bytes, []
    model = onnx.load_from_string(exported.onnx_bytes)
    for node in model.graph.node:
        if node.op_type == "BatchNormalization" and node.domain in ("", "ai.onnx") and any(
                a.name == "training_mode" and a.i for a in node.attribute):
            node.attribute.append(onnx.helper.make_attribute("unbiased_running_var", 1))
    extra = []
    for key, value in exported.buffer_updates.items():
        model.graph.output.append(onnx.helper.make_empty_tensor_value_info(value))
        extra.append((key, value))
    return model.SerializeToString(), extra


def _batch_counters(module: torch.nn.Module, updated: list) -> list:
    """The `num_batches_tracked` buffers of the BatchNorm modules whose running statistics the
    graph updates: the exporters drop that increment, so the runner does it after each call."""
    buffers = dict(module.named_buffers(remove_duplicate=False))
    counters, seen = [], set()
    for key in updated:
        prefix = key.rpartition(".")[0]
        counter = buffers.get(f"{prefix}.num_batches_tracked" if prefix else "num_batches_tracked")
        if counter is not None and id(counter) not in seen:
            seen.add(id(counter))
            counters.append(counter)
    return counters


_THREADS = None
#: references to a storage (torch's private helper; None where this torch lacks it: no pooling)
_STORAGE_USE_COUNT = getattr(torch._C, "_storage_Use_Count", None)


def _init_threads():
    """The engine's pool gets torch's thread count (set once, at the first engine graph)."""
    global _THREADS
    if _THREADS is None:
        _THREADS = _ortrain.init_threads(torch.get_num_threads())


class Runner:
    #: per output, False where it carries no gradient (None: all do)
    seeded_outputs = None
    #: the autograd.Function running it (its name is what grad_fn shows)
    function = EngineFunction
    #: the gradient tensors are allocated at the forward pass and bound from then on (the engine
    #: may write gradients there in the forward pass: Session.forward's `grads`)
    grads_at_forward = False
    #: fp16's dynamic loss scaler (engine/loss_scale.py), set by accelerate(); None: no scaling
    loss_scaler = None

    def __init__(self, module: torch.nn.Module, exported, precision: str = "fp32", device: str = "cpu"):
        """`precision`: "fp32", "bf16" for matmul products in bf16 with f32 accumulation, or
        "fp16" (CUDA only) for the same at fp16.
        `device`: "cpu", or "cuda" (every parameter on one GPU, the runner's; the current CUDA
        device for a module without parameters)."""
        self.on_cuda = device == "cuda"
        self.device = model_gpu(module) if self.on_cuda else torch.device("cpu")
        self.arena_sizes: dict = {}  # CUDA: (input types, backward, bound outputs) -> arena bytes
        # the runner keeps the graph without the parameters' data: the engine binds the live
        # tensors, and the complete export (model-sized) can be freed
        if getattr(exported, "weights", True):
            exported = dataclasses.replace(exported, onnx_bytes=strip_bound_weights(exported.onnx_bytes, exported.param_map),
                                           weights=False)
        self.exported = exported
        named = dict(module.named_parameters(remove_duplicate=False))
        named.update(dict(module.named_buffers(remove_duplicate=False)))
        names, tensors, trainable = [], [], []
        for onnx_name, key in exported.param_map.items():
            t = named.get(key)
            if t is None:
                raise UnsupportedError(f"initializer '{onnx_name}' maps to '{key}', which the module does not have")
            engine_dtype(t, f"parameter '{key}'")
            check_addressable(t, f"parameter '{key}'")
            if t.device != self.device:
                if t.device.type == "cuda" and not self.on_cuda:
                    raise UnsupportedError(f"parameter '{key}' is on {t.device}: pass device='cuda' to ortrain.accelerate")
                raise UnsupportedError(f"parameter '{key}' is on {t.device}; the engine runs this model on {self.device}")
            if not t.is_contiguous():
                raise UnsupportedError(f"parameter '{key}' must be contiguous")
            names.append(onnx_name)
            tensors.append(t)
            trainable.append(exported.param_kinds.get(onnx_name) == "param" and t.requires_grad
                             and t.is_floating_point())
        if not self.on_cuda:
            malloc.apply()  # before the engine's threads start (their malloc arenas)
        _init_threads()
        onnx_bytes, self.buffer_outputs = _with_buffer_outputs(exported)
        seeded = None
        if self.seeded_outputs is not None:
            seeded = list(self.seeded_outputs) + [True] * (len(exported.output_names) + len(self.buffer_outputs) - len(self.seeded_outputs))
        self.session = _ortrain.Session(onnx_bytes, names, trainable, seeded, matmul_precision=precision,
                                        device="cuda" if self.on_cuda else "cpu")
        self.seeded = self.session.seeded
        self.weights = tensors
        self.weight_keys = list(exported.param_map.values())
        # FSDP2 frees the gathered parameters after each backward pass (fully_sharded.py): their
        # memory is checked before the engine reads it
        self.weights_may_be_freed = fully_sharded.is_sharded_root(module)
        self.trainable = trainable
        self.has_grad = self.session.has_grad
        self.input_names = list(exported.input_names)
        self.n_outputs = len(self.session.output_names)
        self.n_user_outputs = self.n_outputs - len(self.buffer_outputs)
        self.trainable_params = [t for t, tr in zip(tensors, trainable) if tr]
        by_key = dict(zip(exported.param_map.values(), tensors))
        self.buffer_targets = [by_key[key] for key, _ in self.buffer_outputs]
        self.batch_counters = _batch_counters(module, [key for key, _ in self.buffer_outputs])
        self._snapshots: list = []
        self._grad_storage: list = [None] * len(self.weights)  # CPU: last step's gradient memory
        self.graphs = None  # CUDA: the graph cache (engine/cuda_graphs.py), set by accelerate

    def weight_addresses(self) -> list:
        if self.weights_may_be_freed:
            self._check_not_freed(self.weights)
        return [t.data_ptr() for t in self.weights]

    def _check_not_freed(self, tensors) -> None:
        for t, key in zip(tensors, self.weight_keys):
            if t is not None and t.numel() and t.untyped_storage().size() == 0:
                raise OrtrainError(f"ortrain: parameter '{key}' has no memory now: FSDP2 freed the whole parameter "
                                   "after the backward pass, and gathers it again at the model's next call")

    def snapshot_params(self, copy: bool = True) -> list:
        """Copies of the trainable parameters (in `trainable_params` order), in memory reused
        from an earlier snapshot that nobody holds any more. `copy=False`: only the memory (the
        caller has the copies written, engine/optimizer.py's deferred copies)."""
        for snap in self._snapshots:
            # references: the pool's list, the loop variable and getrefcount's argument
            if sys.getrefcount(snap) <= 3:
                break
        else:
            snap = [torch.empty_like(p) for p in self.trainable_params]
            if len(self._snapshots) < 2:
                self._snapshots.append(snap)
        if not copy:
            return snap
        with torch.no_grad():
            torch._foreach_copy_(snap, self.trainable_params)  # on CUDA: a few launches, not one per tensor
        return snap

    def addresses_with(self, snapshot: list) -> list:
        """weight_addresses() with the trainable parameters read from `snapshot`."""
        if self.weights_may_be_freed:
            self._check_not_freed([None if tr else t for t, tr in zip(self.weights, self.trainable)])
        it = iter(snapshot)
        return [next(it).data_ptr() if tr else t.data_ptr() for t, tr in zip(self.weights, self.trainable)]

    def new_grad_buffers(self) -> list:
        """Memory for one step's gradients (None where a weight gets none). On the CPU, a
        weight's gradient memory of an earlier step is reused once nothing holds it any more
        (the user's zero_grad() dropped it): a fresh tensor the size of the LM head or the
        embedding would be mapped and page-faulted again every step (blocks of 4 MiB and more go
        back to the system, engine/malloc.py). The pool holds a tensor over the memory and its
        storage; a step gets `detach()` of that tensor (same memory, 1 µs where a tensor made
        over the storage takes 4), which autograd makes the parameter's `.grad` without a copy
        since nothing else references that new tensor."""
        use_count = _STORAGE_USE_COUNT
        out = []
        for i, (t, tr, hg) in enumerate(zip(self.weights, self.trainable, self.has_grad)):
            if not (tr and hg):
                out.append(None)
                continue
            kept = self._grad_storage[i]
            if kept is None or use_count(kept[1]._cdata) != 2:  # held elsewhere besides the pool's two
                base = torch.empty(t.shape, dtype=t.dtype, device=t.device)
                kept = (base, base.untyped_storage())
                if use_count is not None and not self.on_cuda:
                    self._grad_storage[i] = kept
            out.append(kept[0].detach())
        return out

    def wants_grad(self) -> list:
        """Per weight: whether the engine computes its gradient."""
        return [bool(tr and hg) for tr, hg in zip(self.trainable, self.has_grad)]

    def grads_for_trainable(self, grads: list) -> list:
        return [g for g, tr in zip(grads, self.trainable) if tr]

    def __call__(self, inputs: list, grad: bool, seed: int | None = None, bound: dict | None = None) -> list:
        """Runs the graph; returns the user outputs (buffer updates are applied in place).
        `seed` fixes dropout masks; `bound` maps output index -> tensor receiving it."""
        if grad and self.trainable_params:
            outs = self.function.apply(self, len(inputs), seed, bound, *inputs, *self.trainable_params)
        else:
            outs = run_inference(self, [x.detach().contiguous() for x in inputs])
        outs = list(outs)
        if self.buffer_outputs:
            with torch.no_grad():
                for target, new in zip(self.buffer_targets, outs[self.n_user_outputs:]):
                    target.copy_(new)
                for counter in self.batch_counters:
                    counter.add_(1)
        return outs[:self.n_user_outputs]

    def output_types(self, inputs: list) -> list:
        """(torch dtype, shape) of every output for these inputs, without running anything."""
        from .tensors import torch_dtype

        sigs = [(engine_dtype(x, n), list(x.shape)) for x, n in zip(inputs, self.input_names)]
        return [(torch_dtype(d), tuple(s)) for d, s in self.session.output_types(sigs, True)]

    def plan_info(self, inputs: list, backward: bool) -> dict:
        sigs = [(engine_dtype(x, n), list(x.shape)) for x, n in zip(inputs, self.input_names)]
        return self.session.plan_info(sigs, backward, backward and self.grads_at_forward)
