"""The on-device training API, named as onnxruntime.training.api so its users switch by changing imports."""
from odt_ops.api.checkpoint_state import CheckpointState, Parameter
from odt_ops.api.lr_scheduler import (
    ConstantLRScheduler,
    CosineLRScheduler,
    LinearLRScheduler,
    LRScheduler,
    StepLRScheduler,
    WarmupConstantLRScheduler,
)
from odt_ops.api.module import Module, TrainingDivergedError
from odt_ops.api.optimizer import Optimizer

__all__ = ["CheckpointState", "ConstantLRScheduler", "CosineLRScheduler", "LRScheduler", "LinearLRScheduler", "Module",
           "Optimizer", "Parameter", "StepLRScheduler", "TrainingDivergedError", "WarmupConstantLRScheduler"]
