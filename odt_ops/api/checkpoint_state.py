"""CheckpointState: parameters, buffers, optimizer state and a property bag, as in onnxruntime.training.api."""
from __future__ import annotations

import os
from collections.abc import Iterator, MutableMapping

import numpy as np

from odt_ops.checkpoint import Checkpoint, load_checkpoint, save_checkpoint
from odt_ops.errors import CheckpointError

Property = int | float | str


class Parameter:
    """One parameter: ``data`` (get/set), ``grad`` (accumulated gradient, or None), ``requires_grad``."""

    def __init__(self, state: "CheckpointState", name: str):
        self._state, self.name = state, name

    @property
    def data(self) -> np.ndarray:
        return self._state._checkpoint.parameters[self.name]

    @data.setter
    def data(self, value: np.ndarray) -> None:
        current = self.data
        value = np.asarray(value)
        shape, dtype = self._state._checkpoint.spec(self.name)
        if value.shape != shape or value.dtype != dtype:
            raise CheckpointError(f"parameter {self.name!r}: expected {dtype}{list(shape)}, got {value.dtype}{list(value.shape)}")
        if current.size == value.size and current.flags.writeable:
            np.copyto(current, value)  # keep the module's view into its contiguous buffer
        else:
            self._state._checkpoint.parameters[self.name] = value.copy()

    @property
    def grad(self) -> np.ndarray | None:
        return self._state._grads.get(self.name)

    @property
    def requires_grad(self) -> bool:
        return self._state._checkpoint.requires_grad.get(self.name, False)

    def __repr__(self) -> str:
        shape, dtype = self._state._checkpoint.spec(self.name)
        return f"Parameter(name={self.name!r}, shape={list(shape)}, dtype={dtype}, requires_grad={self.requires_grad})"


class Parameters(MutableMapping):
    """Dict-like view of a state's parameters: ``state.parameters["fc.weight"].data``."""

    def __init__(self, state: "CheckpointState"):
        self._state = state

    def __getitem__(self, name: str) -> Parameter:
        if name not in self._state._checkpoint.parameters:
            raise KeyError(f"no parameter {name!r}; the parameters are {list(self._state._checkpoint.parameters)}")
        return Parameter(self._state, name)

    def __setitem__(self, name: str, value: np.ndarray) -> None:
        self[name].data = value

    def __delitem__(self, name: str) -> None:
        raise CheckpointError("parameters cannot be removed from a checkpoint state")

    def __iter__(self) -> Iterator[str]:
        return iter(self._state._checkpoint.parameters)

    def __len__(self) -> int:
        return len(self._state._checkpoint.parameters)


class Properties(MutableMapping):
    """The property bag: str keys, int/float/str values, saved with the checkpoint."""

    def __init__(self, state: "CheckpointState"):
        self._props = state._checkpoint.properties

    def __getitem__(self, key: str) -> Property:
        return self._props[key]

    def __setitem__(self, key: str, value: Property) -> None:
        if not isinstance(key, str) or isinstance(value, bool) or not isinstance(value, (int, float, str)):
            raise CheckpointError(f"property {key!r} = {value!r}: properties are int, float or str")
        self._props[key] = value

    def __delitem__(self, key: str) -> None:
        del self._props[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._props)

    def __len__(self) -> int:
        return len(self._props)


class CheckpointState:
    """The training state shared by a Module and its Optimizer."""

    def __init__(self, checkpoint: Checkpoint, source: str = "<in-memory checkpoint>"):
        self._checkpoint = checkpoint
        self._source = source
        self._grads: dict[str, np.ndarray] = {}  # filled by the Module that binds this state
        self._module = None

    @classmethod
    def load_checkpoint(cls, checkpoint_uri: str | os.PathLike) -> "CheckpointState":
        return cls(load_checkpoint(checkpoint_uri), str(checkpoint_uri))

    @classmethod
    def save_checkpoint(cls, state: "CheckpointState", checkpoint_uri: str | os.PathLike, include_optimizer_state: bool = False) -> None:
        if state._module is not None:
            state._module._sync_to_state()
        save_checkpoint(state._checkpoint, checkpoint_uri, include_optimizer_state=include_optimizer_state)

    @property
    def parameters(self) -> Parameters:
        return Parameters(self)

    @property
    def properties(self) -> Properties:
        return Properties(self)

    @property
    def checkpoint(self) -> Checkpoint:
        """The underlying Checkpoint (for odt_ops.export and tools)."""
        if self._module is not None:
            self._module._sync_to_state()
        return self._checkpoint
