"""The dynamic loss scaler of fp16 mixed precision, inside the engine's backward pass.

With `accelerate(model, opt, device="cuda", precision="fp16")` the gradient flowing into the
engine's outputs is multiplied by the scale (so that small gradients survive fp16 rounding in the
matmuls), and the weight gradients the engine returns are divided by it again, checked for inf/NaN
on the way, before PyTorch accumulates them into `.grad`. So `.grad`, `clip_grad_norm_` and the
optimizer see true gradients, and gradient accumulation over several backward passes works.
`optimizer.step()` is skipped when any gradient since the last step was inf or NaN; the scale
then halves, and doubles after `growth_interval` finite steps in a row: ONNX Runtime's
(and `torch.amp.GradScaler`'s) defaults, a start of 2^16, factors 2 and 1/2, interval 2000.

The state lives in tensors on the parameters' device and is updated with PyTorch's own amp ops
(`_amp_foreach_non_finite_check_and_unscale_`, `_amp_update_scale_`), so nothing waits for the
GPU except the skip decision at each step (as with GradScaler).
"""
from __future__ import annotations

import torch


class DynamicLossScaler:
    def __init__(self, device, init_scale: float = 2.0**16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000):
        self.scale = torch.full((1,), float(init_scale), dtype=torch.float32, device=device)
        self.growth_tracker = torch.zeros((1,), dtype=torch.int32, device=device)
        self.found_inf = torch.zeros((1,), dtype=torch.float32, device=device)
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.growth_interval = int(growth_interval)
        self.steps = 0
        self.skipped_steps = 0

    def scale_seed(self, g: torch.Tensor) -> torch.Tensor:
        """The gradient flowing into an engine output, times the scale."""
        # in f32: 2^16 itself is inf in float16 (an fp16 engine output's seed)
        return (g.float() * self.scale).to(g.dtype)

    def unscale_(self, grads: list) -> None:
        """Divides the engine's gradients by the scale in place, noting any inf/NaN."""
        grads = [g for g in grads if g is not None]
        if grads:
            torch._amp_foreach_non_finite_check_and_unscale_(grads, self.found_inf, self.scale.reciprocal())

    def step(self, optimizer_step):
        """Runs `optimizer_step()` unless a gradient since the last step was inf/NaN, then
        updates the scale; returns what the step returned (None when skipped)."""
        self.steps += 1
        result = None
        if self.found_inf.item() == 0:
            result = optimizer_step()
        else:
            self.skipped_steps += 1
        torch._amp_update_scale_(self.scale, self.growth_tracker, self.found_inf, self.growth_factor,
                                 self.backoff_factor, self.growth_interval)
        self.found_inf.zero_()
        return result

    def state(self) -> dict:
        """What `ortrain.loss_scale(model)` reports."""
        return {"scale": float(self.scale.item()), "steps": self.steps, "skipped_steps": self.skipped_steps,
                "growth_interval": self.growth_interval}


def guard(optimizer, scaler: DynamicLossScaler) -> None:
    """Makes `optimizer.step()` go through `scaler.step` (skipped after an overflow)."""
    if getattr(optimizer, "_ortrain_scaler", None) is scaler:
        return
    unguard(optimizer)
    had_own = "step" in optimizer.__dict__  # e.g. an LR scheduler's counting wrapper
    inner = optimizer.step

    def step(*args, **kwargs):
        return scaler.step(lambda: inner(*args, **kwargs))

    optimizer._ortrain_scaler = scaler
    optimizer._ortrain_unguarded = (had_own, inner)
    optimizer.step = step


def unguard(optimizer) -> None:
    """Undoes `guard`."""
    saved = optimizer.__dict__.pop("_ortrain_unguarded", None)
    optimizer.__dict__.pop("_ortrain_scaler", None)
    if saved is None:
        return
    had_own, inner = saved
    if had_own:
        optimizer.step = inner
    else:
        optimizer.__dict__.pop("step", None)
