"""What a checkpoint holds, whichever format it came from: parameters (trainable and frozen),
buffers, optimizer state, the user's property bag and the engine's own state."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from odt_ops.errors import CheckpointError

Property = int | float | str

ENGINE_RNG = "rng_state"  # Dropout's generator, so a resumed run draws the same masks
LEGACY_ENGINE_PROPERTIES = {"odt.rng_state": ENGINE_RNG}  # where files of earlier versions kept it


@dataclass
class OptimizerState:
    """Per-parameter optimizer tensors (e.g. AdamW's two moments) and the scalars."""

    step: int = 0
    learning_rate: float = 0.0
    initial_learning_rate: float = 0.0
    states: dict[str, dict[str, np.ndarray]] = field(default_factory=dict)  # param -> state name -> array


@dataclass
class Checkpoint:
    """Parameters (trainable and frozen), buffers, optimizer state and a property bag.

    A nominal checkpoint has the parameters' names, shapes and dtypes only: the names in
    ``missing`` hold zero-size placeholders described by ``specs`` and must be filled
    (copy_buffer_to_parameters) before training. Buffers always hold values.
    """

    parameters: dict[str, np.ndarray] = field(default_factory=dict)
    requires_grad: dict[str, bool] = field(default_factory=dict)
    buffers: dict[str, np.ndarray] = field(default_factory=dict)
    optimizer: OptimizerState | None = None
    properties: dict[str, Property] = field(default_factory=dict)
    missing: set[str] = field(default_factory=set)  # names without values (a nominal checkpoint's)
    specs: dict[str, tuple[tuple[int, ...], str]] = field(default_factory=dict)  # of the missing names
    engine: dict[str, str] = field(default_factory=dict)  # the engine's state, e.g. the Dropout generator

    @property
    def nominal(self) -> bool:
        return bool(self.missing)

    def fill(self, name: str) -> None:
        """``name`` now holds its values (copied into a nominal checkpoint's placeholder)."""
        self.missing.discard(name)
        self.specs.pop(name, None)

    def make_nominal(self) -> None:
        """Drop every parameter's values, keeping names, shapes and dtypes."""
        self.specs = {n: (tuple(a.shape), a.dtype.str) for n, a in self.parameters.items()}
        self.missing = set(self.parameters)

    def trainable_names(self) -> list[str]:
        return [n for n in self.parameters if self.requires_grad.get(n, False)]

    def spec(self, name: str) -> tuple[tuple[int, ...], np.dtype]:
        """Shape and dtype of a parameter or buffer, also in a nominal checkpoint."""
        if name in self.specs:
            shape, dtype = self.specs[name]
            return tuple(shape), np.dtype(dtype)
        array = self.parameters.get(name, self.buffers.get(name))
        if array is None:
            raise KeyError(name)
        return tuple(array.shape), array.dtype


def check_matches(checkpoint: Checkpoint, expected: Mapping[str, tuple[tuple[int, ...], np.dtype]], where: str) -> None:
    """Fail with every mismatching name, shape and dtype if the checkpoint does not fit."""
    problems = []
    for name, (shape, dtype) in expected.items():
        try:
            got_shape, got_dtype = checkpoint.spec(name)
        except KeyError:
            problems.append(f"{name}: missing from the checkpoint")
            continue
        if tuple(got_shape) != tuple(shape) or np.dtype(got_dtype) != np.dtype(dtype):
            problems.append(f"{name}: checkpoint has {np.dtype(got_dtype)}{list(got_shape)}, the model needs {np.dtype(dtype)}{list(shape)}")
    if problems:
        raise CheckpointError(f"{where}: the checkpoint does not match the training model:\n  " + "\n  ".join(problems))
