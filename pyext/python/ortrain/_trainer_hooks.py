"""Global hooks around ORTTrainer.train_step, kept free of torch so that the magics can import
them cheaply: step hooks (the step boundary `%%ort` records for ORTTrainer loops) and the
PyTorch-baseline switch (the baseline half of `%%ort baseline|compare`)."""
from __future__ import annotations

import contextlib
import itertools

_step_hooks: dict = {}
_ids = itertools.count()
_baseline_depth = 0


class _Handle:
    def __init__(self, key: int):
        self.key = key

    def remove(self) -> None:
        _step_hooks.pop(self.key, None)


def register_train_step_hook(fn) -> _Handle:
    """Calls `fn(trainer, loss, inputs)` after every ORTTrainer.train_step of any trainer, like
    torch's global optimizer step hooks; returns a handle with `remove()`."""
    key = next(_ids)
    _step_hooks[key] = fn
    return _Handle(key)


def run_step_hooks(trainer, loss, inputs) -> None:
    for hook in list(_step_hooks.values()):
        hook(trainer, loss, inputs)


@contextlib.contextmanager
def pytorch_baseline():
    """Inside, every ORTTrainer.train_step runs its forward and backward in PyTorch eager; the
    gradient accumulation, clipping and optimizer update stay the same as in the engine."""
    global _baseline_depth
    _baseline_depth += 1
    try:
        yield
    finally:
        _baseline_depth -= 1


def in_pytorch_baseline() -> bool:
    return _baseline_depth > 0
