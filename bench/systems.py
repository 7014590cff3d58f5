"""The systems under comparison, each set up the way a user would: PyTorch eager, torch.compile
(default mode) and ortrain.accelerate; and the check that ortrain really runs the model in its
engine (not its fallback to PyTorch). Owns nothing of timing or processes."""
from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass, field
from typing import Callable

import torch

SYSTEMS = ("eager", "compile", "ortrain")


class Unsupported(Exception):
    """The system cannot run this workload at all (reported as "unsupported: ...")."""


class FellBack(Exception):
    """ortrain ran the model (or part of it) in PyTorch instead of its engine."""


@dataclass
class Prepared:
    model: torch.nn.Module  # what the loop calls
    autocast: Callable[[], contextlib.AbstractContextManager]  # around forward + loss
    check: Callable[[list], None] = lambda caught: None  # raises FellBack; `caught`: warnings so far
    notes: list = field(default_factory=list)
    describe: Callable[[], str] = lambda: ""


def _autocast(precision: str):
    if precision == "bf16":
        return lambda: torch.autocast("cpu", dtype=torch.bfloat16)
    return contextlib.nullcontext


def prepare(system: str, model: torch.nn.Module, optimizer, precision: str) -> Prepared:
    if system == "eager":
        return Prepared(model, _autocast(precision))
    if system == "compile":
        return Prepared(torch.compile(model), _autocast(precision))
    if system == "ortrain":
        return _prepare_ortrain(model, optimizer, precision)
    raise ValueError(f"unknown system {system!r}; known: {', '.join(SYSTEMS)}")


def _prepare_ortrain(model, optimizer, precision) -> Prepared:
    import ortrain

    kwargs = {} if precision == "fp32" else {"precision": precision}
    if kwargs:
        try:
            with warnings.catch_warnings():
                # a precision it only warns about is unsupported too
                warnings.filterwarnings("error", message="ortrain")
                ortrain.accelerate(model, optimizer, **kwargs)
        except Exception as exc:  # noqa: BLE001 - any refusal of the precision is "unsupported"
            raise Unsupported(f"accelerate(precision={precision!r}): {type(exc).__name__}: {_first_line(exc)}") from exc
    else:
        ortrain.accelerate(model, optimizer)
    notes = [] if model.__dict__["_ortrain_state"].optimizer_in_engine else ["optimizer step runs in PyTorch"]
    return Prepared(model, contextlib.nullcontext, check=lambda caught: _check_engine(model, caught),
                    notes=notes, describe=lambda: ortrain.explain(model))


def _check_engine(model, caught: list) -> None:
    """Raises FellBack unless every call so far ran in the engine."""
    import ortrain

    for w in caught:
        text = str(w.message)
        if text.startswith("ortrain:") and "PyTorch" in text:
            raise FellBack(f"fell back to PyTorch: {text}")
    if not ortrain.is_accelerated(model):
        raise FellBack("fell back to PyTorch: the model is not accelerated any more")
    state = model.__dict__["_ortrain_state"]
    for runner in state.runners.values():
        if isinstance(runner, Exception):
            raise FellBack(f"fell back to PyTorch: {type(runner).__name__}: {_first_line(runner)}")
    if state.engine_calls != state.calls:
        raise FellBack(f"fell back to PyTorch: {state.calls - state.engine_calls} of {state.calls} calls "
                       "ran outside the engine")


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__
