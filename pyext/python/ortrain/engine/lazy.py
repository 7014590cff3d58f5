"""Deferred model outputs, so that the user's loss can run inside the engine.

In training, an accelerated module whose only output is one float tensor returns a LazyOutput
(inside the module's output structure, e.g. a Hugging Face ModelOutput): a tensor subclass with
the right shape and dtype but no data yet. Basic slicing (`logits[:, :-1, :]`) and views
(`view`, `reshape`, `flatten`, `contiguous`) stay lazy. When it reaches `F.cross_entropy` (what
`nn.CrossEntropyLoss` calls) with class-index targets, the engine runs the model and the loss as
one graph (engine/cross_entropy.py) and returns the loss: their gradient never leaves the
engine, and on the CPU the logits are not even computed (the engine's fused LM head + loss works
chunk by chunk). Any other use materialises the output: after a fused run, by a forward-only
replay of the model with the same dropout seed (exactly the fused run's logits), else a normal
engine forward. So that the logits stay readable after
`optimizer.step()` (accuracy code does that), every optimizer's step first keeps a copy of the
parameters for each fused call whose output is still referenced and not read yet; the replay
reads that copy. A gradient through a materialised fused output is computed by replaying the
forward with the same dropout seed, which requires the parameters unchanged since the forward
pass (as PyTorch itself requires)."""
from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F

from ortrain.fully_sharded import is_fsdp_hook

from .function import EngineFunction, new_seed, run_inference

#: fused calls whose logits were not computed yet and whose output is still referenced
_AWAITING: "weakref.WeakSet[Deferred]" = weakref.WeakSet()
_HOOK = None


def _before_optimizer_step(optimizer, args, kwargs):
    """torch.optim's global step pre-hook: the parameters are about to change."""
    from . import optimizer as engine_optimizer

    engine_optimizer.drop_stale_copies()
    for call in list(_AWAITING):
        call.keep_parameters(optimizer)
    _AWAITING.clear()

_VIEWS = {torch.Tensor.view, torch.Tensor.reshape, torch.reshape, torch.Tensor.flatten, torch.flatten,
          torch.Tensor.contiguous}
_METADATA = {torch.Tensor.size, torch.Tensor.dim, torch.Tensor.numel, torch.Tensor.is_floating_point,
             torch.Tensor.__len__, torch.Tensor.is_contiguous,
             torch.Tensor.shape.__get__, torch.Tensor.dtype.__get__, torch.Tensor.device.__get__,
             torch.Tensor.ndim.__get__, torch.Tensor.requires_grad.__get__, torch.Tensor.layout.__get__,
             torch.Tensor.is_sparse.__get__, torch.Tensor.is_leaf.__get__, torch.Tensor.grad_fn.__get__,
             torch.Tensor._base.__get__}


class Deferred:
    """One model call not run yet: what it needs to run, and what it produced once it ran."""

    def __init__(self, state, runner, key, inputs, args, kwargs, shape, dtype, index=0):
        self.state, self.runner, self.key = state, runner, key
        self.index = index  # which of the runner's outputs this call's output is
        self.inputs, self.args, self.kwargs = inputs, args, kwargs
        self.shape, self.dtype = tuple(shape), dtype
        self.seed = new_seed()
        self.versions = [p._version for p in runner.trainable_params]
        self.fused_logits = None  # the logits a fused loss run wrote (or their replay)
        self.fused = False  # a fused loss ran on this call
        self.snapshot = None  # the trainable parameters as of the forward pass, once they changed
        self.value = None  # the materialised output (with autograd history)
        self.backward_hooks: list = []  # FSDP's hooks on the output, for where its backward starts
        # FSDP2 frees the whole parameters at the end of each backward pass: a copy for a replay
        # of the logits is kept then, not at the optimizer step
        self.sharded = runner.weights_may_be_freed
        self.on_replay = None  # called when the fused run's output is replayed (it was read)

    def add_backward_hook(self, hook):
        """FSDP's pre-backward hook registered on the output (fully_sharded.py), kept without
        computing the output: it goes on the tensor whose backward pass the output's stands for
        (the fused loss, or the output once materialised). FSDP's hook returns the gradient it
        is given, whatever its shape. Returns a handle whose remove() drops it."""
        if self.value is not None:
            return self.value.register_hook(hook)
        self.backward_hooks.append(hook)
        return _HookHandle(self.backward_hooks, hook)

    def move_backward_hooks(self, tensor: torch.Tensor) -> None:
        """The hooks kept so far now registered on `tensor`. Under FSDP2, `tensor`'s backward
        pass also keeps a copy of the parameters for a later replay of the logits, at its end,
        before FSDP's post-backward callback (queued after this one) frees them."""
        if self.sharded and self.backward_hooks:
            tensor.register_hook(self._keep_before_reshard)
        for hook in self.backward_hooks:
            tensor.register_hook(hook)
        self.backward_hooks = []

    def _keep_before_reshard(self, grad):
        torch.autograd.Variable._execution_engine.queue_callback(self._keep_whole_parameters)

    def _keep_whole_parameters(self):
        if self in _AWAITING and self.fused_logits is None and self.snapshot is None and self._unchanged():
            self.snapshot = self.runner.snapshot_params()

    def fused_lazily(self):
        """A fused loss ran without writing the logits: they are replayed if read."""
        global _HOOK
        self.fused = True
        if _HOOK is None:
            from torch.optim.optimizer import register_optimizer_step_pre_hook

            _HOOK = register_optimizer_step_pre_hook(_before_optimizer_step)
        _AWAITING.add(self)

    def keep_parameters(self, optimizer=None):
        """Before an optimizer step: a copy of the parameters for a later replay of the logits.
        The engine's Adam/AdamW writes the copy in its own pass over the parameters (one read of
        them less); any other optimizer gets it copied here."""
        if self.fused_logits is None and self.snapshot is None and self._unchanged() and not self.sharded:
            from . import optimizer as engine_optimizer

            in_step = optimizer is not None and engine_optimizer.step_keeps_copies(optimizer)
            self.snapshot = self.runner.snapshot_params(copy=not in_step)
            if in_step:
                engine_optimizer.defer_copies(self.runner.trainable_params, self.snapshot, self)

    def _unchanged(self) -> bool:
        return [p._version for p in self.runner.trainable_params] == self.versions

    def _replay_logits(self) -> torch.Tensor:
        """The fused run's logits: the model's forward again, same inputs, dropout seed and
        parameter values (the copy kept before an optimizer step, where there was one)."""
        weights = None
        if self.snapshot is not None:
            weights = self.runner.addresses_with(self.snapshot)
        elif not self._unchanged():
            raise RuntimeError("ortrain: the model output of a fused cross-entropy call was read after the "
                               "parameters changed outside an optimizer step; read it before changing them, or "
                               "use ortrain.accelerate(..., fuse_loss=False)")
        inputs = [x.detach().contiguous() for x in self.inputs]
        logits = run_inference(self.runner, inputs, seed=self.seed, weights=weights)[self.index]
        self.snapshot = None
        _AWAITING.discard(self)
        return logits

    def materialize(self) -> torch.Tensor:
        if self.value is None:
            if self.fused and self.fused_logits is None:
                self.fused_logits = self._replay_logits()
                if self.on_replay is not None:
                    self.on_replay()
            if self.fused_logits is not None:
                self.value = _Replay.apply(self, self.fused_logits, *self.runner.trainable_params)
            else:
                self.value = self.state.run_now(self)
            if self.value.requires_grad:
                self.move_backward_hooks(self.value)
        return self.value

    def replay_backward(self, grad: torch.Tensor):
        """Gradients of the parameters for `grad` flowing into the output: the forward again
        (same seed, so the same dropout masks), then its backward."""
        if [p._version for p in self.runner.trainable_params] != self.versions:
            raise RuntimeError("ortrain: a model output was backpropagated after the parameters changed (an "
                               "optimizer step since the forward pass); PyTorch refuses this too")
        with torch.enable_grad():
            out = self.runner(self.inputs, True, seed=self.seed)[self.index]
            torch.autograd.backward(out, grad)


class _HookHandle:
    def __init__(self, hooks: list, hook):
        self.hooks, self.hook = hooks, hook

    def remove(self):
        if self.hook in self.hooks:
            self.hooks.remove(self.hook)


class _Replay(torch.autograd.Function):
    @staticmethod
    def forward(ctx, call, logits, *params):
        ctx.call = call
        return logits.view_as(logits)

    @staticmethod
    def backward(ctx, grad):
        ctx.call.replay_backward(grad)
        return (None, None) + (None,) * len(ctx.call.runner.trainable_params)


class LazyOutput(torch.Tensor):
    """`slices`: ((axis, start, stop), ...) applied to the output first, axes counted from the
    end (-2: the one before last, so that the engine's slice_before_linear pass can move the
    slice onto the LM head's input); `reshaped`: whether a view changed the shape after them
    (slicing is lazy only before that)."""

    @staticmethod
    def __new__(cls, call: Deferred, shape, slices=(), reshaped=False):
        t = torch.Tensor._make_wrapper_subclass(cls, tuple(shape), dtype=call.dtype, device=call.runner.device,
                                                requires_grad=True)
        t._call = call
        t._slices = tuple(slices)
        t._reshaped = reshaped
        return t

    def _value(self) -> torch.Tensor:
        """The real tensor this lazy one stands for."""
        v = self._call.materialize()
        if self._slices:
            index = [slice(None)] * v.dim()
            for axis, start, stop in self._slices:
                index[axis] = slice(start, stop)
            v = v[tuple(index)]
        return v.reshape(self.shape)

    def __repr__(self):
        return repr(self._value())

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _METADATA:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        if func in _VIEWS and isinstance(args[0], LazyOutput):
            x = args[0]
            meta = torch.empty(x.shape, dtype=x.dtype, device="meta")
            shape = func(meta, *args[1:], **kwargs).shape
            return LazyOutput(x._call, shape, x._slices, x._reshaped or tuple(shape) != tuple(x.shape))
        if func is torch.Tensor.__getitem__ and isinstance(args[0], LazyOutput):
            sliced = _lazy_slice(args[0], args[1])
            if sliced is not None:
                return sliced
        if func is torch.Tensor.register_hook and isinstance(args[0], LazyOutput) and is_fsdp_hook(args[1]):
            return args[0]._call.add_backward_hook(args[1])
        if func is F.cross_entropy:
            loss = _fused_cross_entropy(*args, **kwargs)
            if loss is not None:
                return loss
        args, kwargs = _materialize((args, kwargs))
        return func(*args, **kwargs)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        # reached only where torch_function was bypassed: compute on the real values
        args, kwargs = _materialize((args, kwargs or {}))
        return func(*args, **kwargs)


def _lazy_slice(x: LazyOutput, index):
    """x[index] kept lazy for basic slices with step 1 (ints, tensors, steps: None)."""
    if x._reshaped:
        return None
    items = index if isinstance(index, tuple) else (index,)
    if Ellipsis in items:
        k = items.index(Ellipsis)
        items = items[:k] + (slice(None),) * (x.dim() - len(items) + 1) + items[k + 1:]
    if len(items) > x.dim() or not all(isinstance(i, slice) and i.step in (None, 1)
                                       and all(b is None or isinstance(b, int) for b in (i.start, i.stop)) for i in items):
        return None
    slices = list(x._slices)
    for axis, i in enumerate(items):
        if i.start is None and i.stop is None:
            continue
        if any(a == axis - x.dim() for a, _, _ in slices):
            return None  # a second slice of one axis: not worth composing
        slices.append((axis - x.dim(), i.start, i.stop))
    shape = torch.empty(x.shape, device="meta")[index].shape
    return LazyOutput(x._call, shape, slices, False)


def _materialize(tree):
    if isinstance(tree, LazyOutput):
        return tree._value()
    if isinstance(tree, tuple):
        return tuple(_materialize(x) for x in tree)
    if isinstance(tree, list):
        return [_materialize(x) for x in tree]
    if isinstance(tree, dict):
        return {k: _materialize(v) for k, v in tree.items()}
    return tree


def _fused_cross_entropy(input=None, target=None, weight=None, size_average=None, ignore_index=-100, reduce=None,
                         reduction="mean", label_smoothing=0.0):
    """The loss computed in the engine, or None where that does not apply (then the caller
    materialises the output and PyTorch computes the loss)."""
    if not isinstance(input, LazyOutput) or isinstance(target, LazyOutput):
        return None
    call = input._call
    if (call.value is not None or call.fused or call.fused_logits is not None or not torch.is_grad_enabled()
            or weight is not None or size_average is not None or reduce is not None or label_smoothing != 0.0
            or reduction not in ("mean", "sum") or input.dim() != 2 or input.shape[1] != call.shape[-1]
            or any(axis == -1 for axis, _, _ in input._slices)
            or not isinstance(target, torch.Tensor) or target.dtype != torch.int64 or target.dim() != 1
            or target.shape[0] != input.shape[0] or target.device != call.runner.device or target.requires_grad):
        return None
    return call.state.run_cross_entropy(call, input._slices, target, int(ignore_index), reduction)
