"""Step capture for `%%ort`: the step boundary is `optimizer.step()` (a global torch optimizer
step post-hook) or `ORTTrainer.train_step` (ortrain.trainer's step hook), the loss is the sum of
the scalars `backward()` ran on since the last step (Tensor.backward is wrapped for the duration
of the cell; with gradient accumulation over micro-batches whose losses are divided by their
count, as Hugging Face's Trainer does, that sum is the step's loss), the batch shape comes from a
forward pre-hook on the model (the first tensor argument, else `input_ids` or the first tensor
keyword argument: `model(**batch)`). The user's loop is not changed. Everything is removed again
when the cell ends."""
from __future__ import annotations

import math
import time
from dataclasses import dataclass

from ortrain._memory import rss_bytes


class StopCell(BaseException):
    """Raised from the step hook after `--max-steps` steps; ends the cell as FINISHED.
    A BaseException so that a user's `except Exception` does not swallow it."""


@dataclass
class Step:
    index: int
    batch_time_ms: float
    loss: float | None
    loss_kind: str | None
    learning_rate: float | None
    samples: int | None
    tokens: int | None
    rss_bytes: int | None
    #: the dynamic loss scale after this step (fp16 / accelerate(loss_scale="dynamic")), else None
    loss_scale: float | None = None


def find_modules(ns: dict) -> dict:
    """Top-level nn.Modules with parameters in a namespace: {name: module} (one name per object,
    submodules of another found module left out)."""
    import torch

    found = {}
    for name, v in ns.items():
        if name.startswith("_") or not isinstance(v, torch.nn.Module):
            continue
        if any(True for _ in v.parameters()) and all(v is not o for o in found.values()):
            found[name] = v
    children = {id(m) for v in found.values() for m in v.modules() if m is not v}
    return {k: v for k, v in found.items() if id(v) not in children}


def find_trainers(ns: dict) -> dict:
    """ORTTrainers in a namespace: {name: trainer}."""
    from ortrain.trainer import ORTTrainer

    found = {}
    for name, v in ns.items():
        if not name.startswith("_") and isinstance(v, ORTTrainer) and all(v is not o for o in found.values()):
            found[name] = v
    return found


def find_optimizers(ns: dict) -> dict:
    import torch

    found = {}
    for name, v in ns.items():
        if not name.startswith("_") and isinstance(v, torch.optim.Optimizer) and all(v is not o for o in found.values()):
            found[name] = v
    return found


def _batch_dim(model) -> int:
    """0, or 1 for sequence-first models (any submodule with batch_first == False)."""
    for m in model.modules():
        if getattr(m, "batch_first", True) is False:
            return 1
    return 0


class StepRecorder:
    """Context manager that calls `on_step(Step)` after every step of the first optimizer that
    steps, and raises StopCell after `max_steps` steps."""

    def __init__(self, models: list, on_step, max_steps: int | None = None, optimizers: list = ()):
        self.models = models
        self.optimizers = list(optimizers)
        self._wrapped = []
        self._inside_wrapper = 0
        self.on_step = on_step
        self.max_steps = max_steps
        self.steps = 0
        self.optimizer = None
        self._handles = []
        self._last_loss = None
        self._loss_kind = None
        self._input = None
        self._cuda = False

    def __enter__(self):
        import torch
        from torch.optim.optimizer import register_optimizer_step_post_hook

        self._torch = torch
        self._orig_backward = torch.Tensor.backward
        recorder = self
        orig = self._orig_backward

        def backward(tensor, *args, **kwargs):
            if tensor.numel() == 1:
                loss = tensor.detach().reshape(())
                recorder._last_loss = loss if recorder._last_loss is None else recorder._last_loss + loss
                recorder._loss_kind = loss_kind(tensor)
            return orig(tensor, *args, **kwargs)

        backward.__doc__ = orig.__doc__
        torch.Tensor.backward = backward
        self._handles.append(register_optimizer_step_post_hook(self._post_step))
        from ortrain._trainer_hooks import register_train_step_hook

        self._handles.append(register_train_step_hook(self._post_trainer_step))
        for opt in self.optimizers:
            # an optimizer whose step() was replaced on the instance (as an engine may do) can
            # bypass torch's step hooks: wrap it, and count each step once either way
            if "step" in vars(opt):
                orig_step = vars(opt)["step"]

                def step(*args, _orig=orig_step, _opt=opt, **kwargs):
                    recorder._inside_wrapper += 1
                    try:
                        out = _orig(*args, **kwargs)
                    finally:
                        recorder._inside_wrapper -= 1
                    if recorder._inside_wrapper == 0:
                        recorder._post_step(_opt, args, kwargs, _from_wrapper=True)
                    return out

                opt.step = step
                self._wrapped.append((opt, orig_step))
        for m in self.models:
            dim = _batch_dim(m)
            self._handles.append(m.register_forward_pre_hook(
                lambda mod, args, kwargs, d=dim: self._pre_forward(args, kwargs, d), with_kwargs=True))
            p = next(m.parameters(), None)
            self._cuda = self._cuda or (p is not None and p.is_cuda)
        self._last_end = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self._torch.Tensor.backward = self._orig_backward
        for opt, orig_step in self._wrapped:
            opt.step = orig_step
        self._wrapped.clear()
        for h in self._handles:
            h.remove()
        self._handles.clear()
        return False

    def restart_clock(self) -> None:
        """Excludes ortrain's own one-off work (creating the run) from the next batch time."""
        self._last_end = time.perf_counter()

    def _pre_forward(self, args, kwargs, batch_dim):
        torch = self._torch
        if torch.compiler.is_compiling() or torch.jit.is_tracing():
            return  # an exporter tracing the model (symbolic shapes), not a real batch
        x = next((a for a in args if isinstance(a, torch.Tensor)), None)
        if x is None:
            named = kwargs.get("input_ids")
            x = named if isinstance(named, torch.Tensor) else next(
                (v for v in kwargs.values() if isinstance(v, torch.Tensor)), None)
        if x is not None:
            self._input = (tuple(x.shape), x.dtype, batch_dim)

    def _post_trainer_step(self, trainer, loss, inputs):
        """ORTTrainer.train_step ended: its loss and inputs (it runs no nn.Module forward or
        Tensor.backward of the user's that the other hooks would see)."""
        if self.optimizer is None:
            self.optimizer = trainer
        elif trainer is not self.optimizer:
            return
        self._last_loss = loss.detach()
        self._loss_kind = trainer.loss_kind()
        x = inputs[0] if inputs else None
        if x is not None:
            self._input = (tuple(x.shape), x.dtype, _batch_dim(trainer.model))
        self._record(trainer._lr())

    def _post_step(self, optimizer, args, kwargs, _from_wrapper: bool = False):
        if self._inside_wrapper and not _from_wrapper:
            return  # the wrapper around this optimizer's own step() reports it once it returns
        if self.optimizer is None:
            self.optimizer = optimizer
        elif optimizer is not self.optimizer:
            return
        lr = optimizer.param_groups[0].get("lr") if optimizer.param_groups else None
        self._record(lr)

    def _record(self, lr) -> None:
        if self._cuda:
            self._torch.cuda.synchronize()
        now = time.perf_counter()
        dt_ms = (now - self._last_end) * 1000.0
        loss = float(self._last_loss.item()) if self._last_loss is not None else None
        lr = float(lr) if lr is not None else None
        samples = tokens = None
        if self._input is not None:
            shape, dtype, bdim = self._input
            if shape:
                samples = shape[bdim] if len(shape) > bdim else shape[0]
                if not dtype.is_floating_point and not dtype.is_complex:
                    tokens = math.prod(shape)
        scaler = getattr(self.optimizer, "_ortrain_scaler", None)
        scale = float(scaler.scale.item()) if scaler is not None else None
        step = Step(self.steps, dt_ms, loss, self._loss_kind, lr, samples, tokens, rss_bytes(), scale)
        self.steps += 1
        self._last_loss = None
        self.on_step(step)
        self._last_end = time.perf_counter() if self.steps == 1 else now
        if self.max_steps is not None and self.steps >= self.max_steps:
            raise StopCell()


#: grad_fns `loss_kind` looks through: those that re-type or reshape their one differentiable
#: input, and a product or quotient by a number or by a tensor without a gradient
_SEEN_THROUGH = frozenset(("ToCopyBackward0", "CloneBackward0", "AliasBackward0", "ViewBackward0",
                           "ReshapeAliasBackward0", "UnsqueezeBackward0", "SqueezeBackward0", "SqueezeBackward1",
                           "SqueezeBackward4", "MulBackward0", "MulBackward1", "DivBackward0", "DivBackward1"))


def loss_kind(loss) -> str | None:
    """The name of the grad_fn that made `loss`, seen through casts, reshapes and scalings by
    what has no gradient: HF's sum / num_items_in_batch and the Trainer's times the process
    count, or a loop's loss / accumulation_steps, are still a per-token cross-entropy, whose
    perplexity is logged (engine/model_loss.py applies the same rule to an exported loss)."""
    fn = loss.grad_fn
    while fn is not None and type(fn).__name__ in _SEEN_THROUGH:
        inputs = [f for f, _ in fn.next_functions]
        if type(fn).__name__ == "DivBackward0" and inputs[1:2] != [None]:
            break  # a quotient by something with a gradient, or of something without one
        ahead = [f for f in inputs if f is not None]
        if len(ahead) != 1:
            break
        fn = ahead[0]
    return type(fn).__name__ if fn is not None else None


def is_cross_entropy(loss_kind: str | None) -> bool:
    return bool(loss_kind) and ("NllLoss" in loss_kind or "CrossEntropy" in loss_kind)


def step_metrics(step: Step) -> dict:
    """The per-step metrics ortrain logs."""
    m = {"batch_time_ms": step.batch_time_ms}
    if step.loss is not None:
        m["loss"] = step.loss
        if is_cross_entropy(step.loss_kind):
            m["ppl"] = math.exp(min(step.loss, 700.0)) if not math.isnan(step.loss) else math.nan
    if step.learning_rate is not None:
        m["learning_rate"] = step.learning_rate
    sec = step.batch_time_ms / 1000.0
    if sec > 0 and step.samples:
        m["samples_per_sec"] = step.samples / sec
    if sec > 0 and step.tokens:
        m["tokens_per_sec"] = step.tokens / sec
    if step.loss_scale is not None:
        m["loss_scale"] = step.loss_scale
    return m
