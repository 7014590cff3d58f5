"""Optimizer configurations for ORTTrainer (SGDConfig, AdamConfig, LambConfig, with per-group
hyper-parameters) and learning-rate schedulers with warmup (Constant, Cosine, Linear, Poly),
as ONNX Runtime Training offered them."""
from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass
class _Config:
    lr: float = 1e-3
    #: [{"params": [names], <hyper-parameter>: value, ...}]: per-group overrides by parameter name
    params: list = field(default_factory=list)

    def for_param(self, name: str) -> dict:
        hp = {k: v for k, v in vars(self).items() if k != "params"}
        for group in self.params:
            if name in group.get("params", ()):
                hp.update({k: v for k, v in group.items() if k != "params"})
        return hp

    def validate(self):
        if not self.lr > 0:
            raise ValueError(f"{type(self).__name__}.lr must be > 0, got {self.lr}")
        for i, g in enumerate(self.params):
            unknown = set(g) - set(vars(self))
            if "params" not in g or unknown:
                raise ValueError(f"{type(self).__name__}.params[{i}] needs 'params' (names) and may set "
                                 f"{sorted(k for k in vars(self) if k != 'params')}; unknown: {sorted(unknown)}")


@dataclass
class SGDConfig(_Config):
    lr: float = 1e-3
    momentum: float = 0.0
    dampening: float = 0.0
    weight_decay: float = 0.0
    nesterov: bool = False


@dataclass
class AdamConfig(_Config):
    lr: float = 1e-3
    alpha: float = 0.9  # beta1, ORT's name
    beta: float = 0.999  # beta2
    epsilon: float = 1e-8
    lambda_coef: float = 0.0  # weight decay
    decoupled_weight_decay: bool = False  # AdamW
    do_bias_correction: bool = True

    def validate(self):
        super().validate()
        if not self.do_bias_correction:
            raise ValueError("AdamConfig(do_bias_correction=False) is not supported yet")


@dataclass
class LambConfig(_Config):
    lr: float = 1e-3
    alpha: float = 0.9
    beta: float = 0.999
    epsilon: float = 1e-6
    lambda_coef: float = 0.0
    do_bias_correction: bool = True
    ratio_min: float = 0.0
    ratio_max: float = float("inf")


class _LRScheduler:
    """lr(step) = base_lr · factor(step); warmup is linear from 0 over `warmup` of total_steps."""

    def __init__(self, total_steps: int, warmup: float = 0.0):
        if total_steps <= 0:
            raise ValueError(f"total_steps must be > 0, got {total_steps}")
        if not 0.0 <= warmup < 1.0:
            raise ValueError(f"warmup is a fraction of total_steps in [0, 1), got {warmup}")
        self.total_steps = total_steps
        self.warmup = warmup

    def factor(self, step: int) -> float:
        progress = step / self.total_steps
        if progress < self.warmup:
            return progress / self.warmup
        return self._decay(progress)

    def _decay(self, progress: float) -> float:
        return 1.0


class ConstantWarmupLRScheduler(_LRScheduler):
    pass


class CosineWarmupLRScheduler(_LRScheduler):
    def __init__(self, total_steps: int, warmup: float = 0.002, cycles: float = 0.5):
        super().__init__(total_steps, warmup)
        self.cycles = cycles

    def _decay(self, progress):
        p = (progress - self.warmup) / max(1e-12, 1 - self.warmup)
        return 0.5 * (1.0 + math.cos(math.pi * self.cycles * 2.0 * p))


class LinearWarmupLRScheduler(_LRScheduler):
    def _decay(self, progress):
        return max((progress - 1.0) / (self.warmup - 1.0), 0.0)


class PolyWarmupLRScheduler(_LRScheduler):
    def __init__(self, total_steps: int, warmup: float = 0.002, power: float = 1.0):
        super().__init__(total_steps, warmup)
        self.power = power

    def _decay(self, progress):
        p = (progress - self.warmup) / max(1e-12, 1 - self.warmup)
        return max(0.0, 1.0 - p) ** self.power
