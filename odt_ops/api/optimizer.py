"""Optimizer: applies the optimizer artifact to a Module's parameters, as in onnxruntime.training.api.

The update runs as one in-place numpy pass over the Module's contiguous parameter
buffer (the same arithmetic as the optimizer graph; tests hold the two equal). Its
state (step, learning rate, moments) lives in the CheckpointState, so saving the
state with include_optimizer_state=True and loading it later resumes exactly.
"""
from __future__ import annotations

import os

import numpy as np

from odt_ops import meta
from odt_ops.api.module import FlatBuffers, Module
from odt_ops.checkpoint import OptimizerState
from odt_ops.errors import ArtifactError, CheckpointError
from odt_ops.ir.load import read_model
from odt_ops.onnxblock import optim

DEFAULT_LR = 1e-3

_KINDS = {"SGD": optim.SGD, "AdamW": optim.AdamW, "Adam": optim.Adam}


def optimizer_from_metadata(data: dict, source: str) -> optim.Optimizer:
    cls = _KINDS.get(data.get("kind"))
    if cls is None:
        raise ArtifactError(f"{source}: unknown optimizer kind {data.get('kind')!r}; known: {sorted(_KINDS)}")
    params = dict(data.get("hyperparameters", {}))
    if "betas" in params:
        params["betas"] = tuple(params["betas"])
    return cls(**params)


class Optimizer:
    def __init__(self, optimizer_uri: str | os.PathLike, module: Module):
        proto = read_model(optimizer_uri)
        data = meta.read_optimizer(proto.proto, proto.source)
        self._opt = optimizer_from_metadata(data, proto.source)
        listed = [p["name"] for p in data["parameters"]]
        if listed != module._info.trainable:
            raise ArtifactError(f"{proto.source}: the optimizer updates {listed}, the training model trains {module._info.trainable}")
        self._module = module
        ckpt = module._state._checkpoint
        saved = ckpt.optimizer
        self._states = {s: module.params.like() for s in self._opt.state_names}
        if saved is None:
            ckpt.optimizer = OptimizerState(step=0, learning_rate=DEFAULT_LR, initial_learning_rate=DEFAULT_LR)
        else:
            for pname in module.params.names:
                for sname, flat in self._states.items():
                    value = saved.states.get(pname, {}).get(sname)
                    if value is None:
                        raise CheckpointError(f"{module._state._source}: optimizer state {sname!r} of {pname!r} is missing")
                    np.copyto(flat.views[pname], value)
        ckpt.optimizer.states = {p: {s: flat.views[p] for s, flat in self._states.items()} for p in module.params.names}
        self._state = ckpt.optimizer

    def step(self) -> None:
        """One update of every trainable parameter from its accumulated gradient."""
        self._module.require_loaded()
        self._state.step += 1
        params, grads = self._module.params, self._module.grads
        for dtype, buffer in params.buffers.items():
            states = [[flat.buffers[dtype] for flat in self._states.values()]]
            self._opt.update([buffer], [grads.buffers[dtype]], states, self._state.learning_rate, self._state.step)

    def set_learning_rate(self, learning_rate: float) -> None:
        self._state.learning_rate = float(learning_rate)

    def get_learning_rate(self) -> float:
        return float(self._state.learning_rate)

    @property
    def optimizer(self) -> optim.Optimizer:
        """The optimizer block (kind and hyperparameters) this artifact was built with."""
        return self._opt


__all__ = ["FlatBuffers", "Optimizer"]
