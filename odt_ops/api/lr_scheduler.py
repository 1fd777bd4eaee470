"""Learning-rate schedulers: each ``step()`` sets the optimizer's rate for the next update.

LinearLRScheduler has the documented meaning of onnxruntime's (linear warm-up from 0
to ``initial_lr`` over ``warmup_step_count`` steps, then linear decay to 0 at
``total_step_count``); its Python wrapper passed the two counts swapped, we do not.
"""
from __future__ import annotations

import math

from odt_ops.api.optimizer import Optimizer
from odt_ops.errors import ArgumentError


class LRScheduler:
    def __init__(self, optimizer: Optimizer, initial_lr: float):
        if initial_lr < 0:
            raise ArgumentError(f"initial_lr must be >= 0, got {initial_lr}")
        self._optimizer = optimizer
        self.initial_lr = float(initial_lr)
        self._step = 0
        optimizer.set_learning_rate(self.factor(0) * self.initial_lr)
        progress = optimizer.training_state.optimizer
        assert progress is not None, "an Optimizer sets the optimizer state when it is built"
        progress.initial_learning_rate = self.initial_lr

    def factor(self, step: int) -> float:
        raise NotImplementedError

    def step(self) -> None:
        self._step += 1
        self._optimizer.set_learning_rate(self.factor(self._step) * self.initial_lr)


class ConstantLRScheduler(LRScheduler):
    def factor(self, step: int) -> float:
        return 1.0


class LinearLRScheduler(LRScheduler):
    def __init__(self, optimizer: Optimizer, warmup_step_count: int, total_step_count: int, initial_lr: float):
        if not 0 <= warmup_step_count <= total_step_count:
            raise ArgumentError(f"need 0 <= warmup_step_count ({warmup_step_count}) <= total_step_count ({total_step_count})")
        self.warmup, self.total = int(warmup_step_count), int(total_step_count)
        super().__init__(optimizer, initial_lr)

    def factor(self, step: int) -> float:
        if step < self.warmup:
            return step / max(1, self.warmup)
        return max(0.0, (self.total - step) / max(1, self.total - self.warmup))


class CosineLRScheduler(LRScheduler):
    """Linear warm-up, then cosine decay from initial_lr to min_lr_ratio * initial_lr."""

    def __init__(self, optimizer: Optimizer, warmup_step_count: int, total_step_count: int, initial_lr: float, min_lr_ratio: float = 0.0):
        if not 0 <= warmup_step_count <= total_step_count:
            raise ArgumentError(f"need 0 <= warmup_step_count ({warmup_step_count}) <= total_step_count ({total_step_count})")
        self.warmup, self.total, self.min_ratio = int(warmup_step_count), int(total_step_count), float(min_lr_ratio)
        super().__init__(optimizer, initial_lr)

    def factor(self, step: int) -> float:
        if step < self.warmup:
            return step / max(1, self.warmup)
        progress = min(1.0, (step - self.warmup) / max(1, self.total - self.warmup))
        return self.min_ratio + (1 - self.min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


class StepLRScheduler(LRScheduler):
    """Multiply the rate by ``gamma`` every ``step_size`` steps (torch's StepLR)."""

    def __init__(self, optimizer: Optimizer, step_size: int, gamma: float, initial_lr: float):
        if step_size < 1:
            raise ArgumentError(f"step_size must be >= 1, got {step_size}")
        self.step_size, self.gamma = int(step_size), float(gamma)
        super().__init__(optimizer, initial_lr)

    def factor(self, step: int) -> float:
        return self.gamma ** (step // self.step_size)


class WarmupConstantLRScheduler(LRScheduler):
    """Linear warm-up to the rate over ``warmup_step_count`` steps, then constant."""

    def __init__(self, optimizer, warmup_step_count: int, initial_lr: float):
        self.warmup = int(warmup_step_count)
        super().__init__(optimizer, initial_lr)

    def factor(self, step: int) -> float:
        return min(1.0, step / self.warmup)
