"""CheckpointState: parameters, buffers, optimizer state and a property bag, as in onnxruntime.training.api.

The state and the views it hands out (Parameter, parameters, properties) read the
Checkpoint through the state's TrainingState, the object a Module, its Optimizer and the
schedulers share with it.
"""
from __future__ import annotations

import os
from collections.abc import Iterator

import numpy as np

from odt_ops.api.training_state import TrainingState
from odt_ops.checkpoint import Checkpoint, load_checkpoint, save_checkpoint
from odt_ops.errors import CheckpointError, NonFiniteValueError

Property = int | float | str


class Parameter:
    """One parameter: ``data`` (get/set), ``grad`` (accumulated gradient, or None), ``requires_grad``."""

    def __init__(self, state: CheckpointState, name: str):
        self._training, self.name = state.training_state, name

    @property
    def data(self) -> np.ndarray:
        return self._training.checkpoint.parameters[self.name]

    @data.setter
    def data(self, value: np.ndarray) -> None:
        current = self.data
        value = np.asarray(value)
        shape, dtype = self._training.checkpoint.spec(self.name)
        if value.shape != shape or value.dtype != dtype:
            raise CheckpointError(f"parameter {self.name!r}: expected {dtype}{list(shape)}, got {value.dtype}{list(value.shape)}")
        if current.size == value.size and current.flags.writeable:
            np.copyto(current, value)  # keep the module's view into its contiguous buffer
        else:
            self._training.checkpoint.parameters[self.name] = value.copy()

    @property
    def grad(self) -> np.ndarray | None:
        return self._training.grads.views.get(self.name)

    @property
    def requires_grad(self) -> bool:
        return self._training.checkpoint.requires_grad.get(self.name, False)

    def __repr__(self) -> str:
        shape, dtype = self._training.checkpoint.spec(self.name)
        return f"Parameter(name={self.name!r}, shape={list(shape)}, dtype={dtype}, requires_grad={self.requires_grad})"


class _PairView:
    """A read-write view of named entries that iterates as ONNX Runtime's does: ``for name, value in view``.
    ``keys()``, ``values()``, ``items()`` and ``get()`` give the dict idioms."""

    def _names(self) -> list[str]:
        raise NotImplementedError

    def __getitem__(self, name: str) -> object:
        raise NotImplementedError

    def __iter__(self) -> Iterator[tuple[str, object]]:
        for name in self._names():
            yield name, self[name]

    def __len__(self) -> int:
        return len(self._names())

    def __contains__(self, name: object) -> bool:
        return name in self._names()

    def keys(self) -> list[str]:
        return self._names()

    def values(self) -> list:
        return [self[n] for n in self._names()]

    def items(self) -> list[tuple[str, object]]:
        return list(self)

    def get(self, name: str, default=None):
        return self[name] if name in self else default  # noqa: SIM401 - this is get() itself


class Parameters(_PairView):
    """The state's parameters: ``state.parameters["fc.weight"].data``; iterating yields
    ``(name, Parameter)`` pairs, as ONNX Runtime's does."""

    def __init__(self, state: CheckpointState):
        self._state, self._training = state, state.training_state

    def _names(self) -> list[str]:
        return list(self._training.checkpoint.parameters)

    def __getitem__(self, name: str) -> Parameter:
        ckpt = self._training.checkpoint
        if name not in ckpt.parameters:
            raise KeyError(f"no parameter {name!r}; the parameters are {list(ckpt.parameters)}")
        if name in ckpt.missing:
            raise CheckpointError(f"{self._training.source}: {name!r} has no values in this nominal checkpoint. Please load the "
                                  "parameter states first (module.copy_buffer_to_parameters(buffer, trainable_only=False))")
        return Parameter(self._state, name)

    def __setitem__(self, name: str, value: np.ndarray) -> None:
        if name in self._training.checkpoint.missing:
            raise CheckpointError(f"{self._training.source}: cannot set {name!r} of a nominal checkpoint one by one. Please load "
                                  "all the parameter states first (module.copy_buffer_to_parameters(buffer, trainable_only=False))")
        self[name].data = value


class Properties(_PairView):
    """The property bag: str keys, int/float/str values, saved with the checkpoint; iterating
    yields ``(key, value)`` pairs, as ONNX Runtime's does."""

    def __init__(self, state: CheckpointState):
        self._props = state.training_state.checkpoint.properties

    def _names(self) -> list[str]:
        return list(self._props)

    def __getitem__(self, key: str) -> Property:
        return self._props[key]

    def __setitem__(self, key: str, value: Property) -> None:
        if not isinstance(key, str) or isinstance(value, bool) or not isinstance(value, (int, float, str)):
            raise CheckpointError(f"property {key!r} = {value!r}: properties are int, float or str")
        self._props[key] = value

    def __delitem__(self, key: str) -> None:
        del self._props[key]


def _refuse_non_finite(ckpt: Checkpoint, path, source: str, include_optimizer_state: bool) -> None:
    """Raise, naming them, when parameters, buffers or (saved) optimizer states hold NaN or
    infinities: a checkpoint that cannot train any more is better not written over a good one."""
    arrays = [(n, a) for n, a in (*ckpt.parameters.items(), *ckpt.buffers.items()) if n not in ckpt.missing]
    if include_optimizer_state and ckpt.optimizer is not None:
        arrays += [(f"{p} ({s})", a) for p, states in ckpt.optimizer.states.items() for s, a in states.items()]
    bad = [(n, int(np.size(a) - np.count_nonzero(np.isfinite(a)))) for n, a in arrays
           if np.asarray(a).dtype.kind in "fc" and not np.all(np.isfinite(a))]
    if bad:
        listed = ", ".join(f"{n!r} ({k} values)" for n, k in bad[:8]) + (", ..." if len(bad) > 8 else "")
        raise NonFiniteValueError(f"{path}: not saved: {listed} hold NaN or infinite values (the state loaded from "
                                  f"{source}, trained since); training diverged before this point, or those values came "
                                  "with it. Load the last good checkpoint and lower the learning rate")


class CheckpointState:
    """The training state shared by a Module and its Optimizer (``training_state``, which a Module
    binding this state fills in)."""

    def __init__(self, checkpoint: Checkpoint, source: str = "<in-memory checkpoint>"):
        self.training_state = TrainingState(checkpoint, source)

    @classmethod
    def load_checkpoint(cls, checkpoint_uri: str | os.PathLike) -> CheckpointState:
        return cls(load_checkpoint(checkpoint_uri), str(checkpoint_uri))

    @classmethod
    def save_checkpoint(cls, state: CheckpointState, checkpoint_uri: str | os.PathLike, include_optimizer_state: bool = False) -> None:
        state.training_state.sync()
        _refuse_non_finite(state.training_state.checkpoint, checkpoint_uri, state.training_state.source, include_optimizer_state)
        save_checkpoint(state.training_state.checkpoint, checkpoint_uri, include_optimizer_state=include_optimizer_state)

    @property
    def parameters(self) -> Parameters:
        return Parameters(self)

    @property
    def properties(self) -> Properties:
        return Properties(self)

    # ONNX Runtime 1.16's spelling: state[name] is a parameter, else a property
    def __getitem__(self, name: str) -> Parameter | Property:
        return self.parameters[name] if name in self.parameters else self.properties[name]

    def __setitem__(self, name: str, value) -> None:
        if name in self.parameters:
            self.parameters[name] = value
        else:
            self.properties[name] = value

    def __contains__(self, name: str) -> bool:
        return name in self.parameters or name in self.properties

    @property
    def checkpoint(self) -> Checkpoint:
        """The underlying Checkpoint (for odt_ops.export and tools)."""
        self.training_state.sync()
        return self.training_state.checkpoint
