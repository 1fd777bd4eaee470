"""Optimizer: applies the optimizer artifact to a Module's parameters, as in onnxruntime.training.api.

The update runs as one in-place numpy pass over the Module's contiguous parameter
buffer (the same arithmetic as the optimizer graph; tests hold the two equal). Its
state (step, learning rate, moments) lives in the CheckpointState (reached through the
Module's ``training_state``), so saving the state with include_optimizer_state=True and
loading it later resumes exactly.
"""
from __future__ import annotations

import os

import numpy as np

from odt_ops import meta
from odt_ops.api.module import Module
from odt_ops.api.training_state import TrainingState
from odt_ops.checkpoint import OptimizerState
from odt_ops.errors import ArgumentError, ArgumentTypeError, ArtifactError, CheckpointError
from odt_ops.ir.load import read_model
from odt_ops.onnxblock import optim
from odt_ops.scalars import as_real, finite_at_least_zero

DEFAULT_LR = 1e-3

_KINDS = {"SGD": optim.SGD, "AdamW": optim.AdamW, "Adam": optim.Adam}


def optimizer_from_metadata(data: dict, source: str) -> optim.Optimizer:
    kind = data.get("kind")
    cls = _KINDS.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise ArtifactError(f"{source}: unknown optimizer kind {data.get('kind')!r}; known: {sorted(_KINDS)}")
    params = dict(data.get("hyperparameters", {}))
    try:
        if "betas" in params:
            params["betas"] = tuple(params["betas"])
        return cls(**params)
    except (TypeError, ValueError) as exc:
        raise ArtifactError(f"{source}: the {data.get('kind')} hyperparameters {params} are damaged: {exc}") from None


def checked_learning_rate(learning_rate) -> float:
    """``learning_rate`` as a float, or a typed error naming it: a NaN, infinite or negative rate
    would turn every parameter non-finite or climb the loss at the next step, in silence."""
    rate = as_real(learning_rate)
    if rate is None:
        raise ArgumentTypeError(f"set_learning_rate({learning_rate!r}): the learning rate is a number, "
                                f"got {type(learning_rate).__name__}; pass a float such as 1e-3")
    if not finite_at_least_zero(rate):
        raise ArgumentError(f"set_learning_rate({learning_rate!r}): the learning rate must be a finite number >= 0; "
                            "the optimizer state was left as it was")
    return rate


class Optimizer:
    def __init__(self, optimizer_uri: str | os.PathLike, module: Module):
        proto = read_model(optimizer_uri)
        data = meta.read_optimizer(proto.proto, proto.source)
        self._opt = optimizer_from_metadata(data, proto.source)
        # what this Optimizer shares with the Module, the CheckpointState and the schedulers
        self.training_state: TrainingState = module.training_state
        ts = self.training_state
        if ts.roles is None:  # set when a Module binds the state (Module.__init__ does)
            raise ArgumentError(f"Optimizer({optimizer_uri!r}, module): the module's training state is bound to no training "
                                "model; pass a Module built from the training artifact")
        listed = [p["name"] for p in data["parameters"]]
        if listed != ts.roles.trainable:
            raise ArtifactError(f"{proto.source}: the optimizer updates {listed}, the training model trains {ts.roles.trainable}")
        ckpt = ts.checkpoint
        saved = ckpt.optimizer
        self._states = {s: module.params.like() for s in self._opt.state_names}
        if saved is None:
            saved = ckpt.optimizer = OptimizerState(step=0, learning_rate=DEFAULT_LR, initial_learning_rate=DEFAULT_LR)
        else:
            for pname in module.params.names:
                for sname, flat in self._states.items():
                    value = saved.states.get(pname, {}).get(sname)
                    if value is None:
                        raise CheckpointError(f"{ts.source}: optimizer state {sname!r} of {pname!r} is missing")
                    np.copyto(flat.views[pname], value)
        saved.states = {p: {s: flat.views[p] for s, flat in self._states.items()} for p in module.params.names}
        self._progress: OptimizerState = saved  # step and learning rates; the same object as ts.optimizer
        # per dtype: the update's arguments, made once (the buffers never move)
        grads = module.grads
        self._groups = [([buffer], [grads.buffers[dtype]], [[flat.buffers[dtype] for flat in self._states.values()]])
                        for dtype, buffer in module.params.buffers.items()]

    def step(self) -> None:
        """One update of every trainable parameter from its accumulated gradient."""
        self.training_state.require_loaded()
        progress = self._progress
        progress.step += 1
        for params, grads, states in self._groups:
            self._opt.update(params, grads, states, progress.learning_rate, progress.step)

    def set_learning_rate(self, learning_rate: float) -> None:
        self._progress.learning_rate = checked_learning_rate(learning_rate)

    def get_learning_rate(self) -> float:
        return float(self._progress.learning_rate)

    @property
    def optimizer(self) -> optim.Optimizer:
        """The optimizer block (kind and hyperparameters) this artifact was built with."""
        return self._opt


__all__ = ["Optimizer"]
