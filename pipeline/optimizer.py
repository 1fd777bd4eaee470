"""The ``optimizer`` section: the optimizer graph's block node (baked into the artifacts), the
learning rate and its schedule (fed at every step), and the schedule it configures."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from odt_ops.api import ConstantLRScheduler, CosineLRScheduler, LinearLRScheduler, LRScheduler, WarmupConstantLRScheduler
from pipeline.config import MISSING, OPTIMIZER, Section


class ScheduleName(Enum):
    constant = "constant"
    linear = "linear"
    cosine = "cosine"


@dataclass
class ScheduleConfig(Section):
    name: ScheduleName = MISSING
    warmup_steps: int = MISSING

    def check(self) -> None:
        self.need(self.warmup_steps >= 0, "warmup_steps", "an integer >= 0")


@dataclass
class OptimizerConfig(Section):
    """``block`` is baked into optimizer_model.onnx (generate's param); ``lr`` and
    ``schedule`` are fed at every step (train's params), so a new rate never regenerates."""

    block: dict[str, Any] = OPTIMIZER.field()
    lr: float = MISSING
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)

    def check(self) -> None:
        self.need(math.isfinite(self.lr) and self.lr > 0, "lr", "a finite number > 0")


def scheduler(optimizer, opt_cfg, total_steps: int) -> LRScheduler:
    """The configured schedule over ``total_steps`` (odt_ops.api LR schedulers); each
    has a linear warm-up over ``schedule.warmup_steps``."""
    s = opt_cfg.schedule
    warmup = min(int(s.warmup_steps), total_steps)
    if s.name is ScheduleName.linear:
        return LinearLRScheduler(optimizer, warmup, max(total_steps, 1), opt_cfg.lr)
    if s.name is ScheduleName.cosine:
        return CosineLRScheduler(optimizer, warmup, max(total_steps, 1), opt_cfg.lr)
    return WarmupConstantLRScheduler(optimizer, warmup, opt_cfg.lr) if warmup else ConstantLRScheduler(optimizer, opt_cfg.lr)
