"""Optimizers made after `accelerate(model)`: Hugging Face's Trainer makes its AdamW inside
`train()`, and `%ort accelerate` may run before the cell that makes one. At its first step, a
torch Adam, AdamW or SGD whose parameters all belong to an accelerated model that has no
optimizer yet is taken into the engine as `accelerate(model, optimizer)` would take it: that
first step runs in PyTorch (it has begun when the step hook sees it), every later one in the
engine. Wrappers such as accelerate's AcceleratedOptimizer are left alone: the optimizer they
hold steps through here too."""
from __future__ import annotations

import weakref

#: accelerated models' states (accelerate.py's _State) that have no optimizer yet
_WAITING: "weakref.WeakSet" = weakref.WeakSet()
#: optimizers already looked at (each is decided at its first step)
_SEEN: "weakref.WeakSet" = weakref.WeakSet()
_HOOK: list = []


def wait_for_optimizer(state) -> None:
    """`state`'s model has no optimizer: the first fitting optimizer to step becomes its own."""
    if not _HOOK:
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        _HOOK.append(register_optimizer_step_pre_hook(_at_step))
    _WAITING.add(state)


def forget(state) -> None:
    if state is not None:
        _WAITING.discard(state)


def _at_step(optimizer, args, kwargs) -> None:
    if not _WAITING or optimizer in _SEEN:
        return
    _SEEN.add(optimizer)
    from ortrain.engine.optimizer import engine_type

    if not engine_type(optimizer) or getattr(optimizer, "_ortrain_base", None) is not None:
        return
    params = {id(p) for g in optimizer.param_groups for p in g["params"]}
    for state in list(_WAITING):
        if state.optimizer is not None:
            _WAITING.discard(state)
        elif params and params <= {id(p) for p in state.parameters()}:
            _WAITING.discard(state)
            from ortrain.accelerate import accelerate

            accelerate(state.module, optimizer, strict=state.strict)
            state.optimizer_taken_at_step = True
            return
