"""What the api/ classes share, as one object with public fields, and a compiled step.

A ``CheckpointState`` makes its ``TrainingState`` (the Checkpoint and where it came
from); a ``Module`` binding the state fills in the rest with ``bind`` (the artifact
roles, the flat parameter, frozen and gradient buffers the Checkpoint's arrays become
views into, the buffers, the Dropout generator); the ``Optimizer`` and the learning-rate
schedulers reach the optimizer state through it. Nothing in api/ touches another
class's private attributes: what one needs from another is here.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

import numpy as np

from odt_ops import meta
from odt_ops.checkpoint import ENGINE_RNG, Checkpoint, OptimizerState, check_matches
from odt_ops.errors import CheckpointError
from odt_ops.runtime.plan import Plan
from odt_ops.runtime.session import ValueSpec

# ONNX Runtime's words, so code that matches its message keeps working
NOMINAL_NOT_LOADED = "Please load the model parameters first."


class FlatBuffers:
    """Named arrays laid out back to back in one buffer per dtype; the matrices named in
    ``transposed`` are stored column by column (their views are F-ordered)."""

    def __init__(self, specs: dict[str, tuple[tuple[int, ...], np.dtype]], transposed: frozenset[str] = frozenset()):
        self.names = list(specs)
        self.specs = specs
        self.transposed = frozenset(n for n in transposed if n in specs and len(specs[n][0]) == 2)
        self.buffers: dict[np.dtype, np.ndarray] = {}
        self.views: dict[str, np.ndarray] = {}
        sizes: dict[np.dtype, int] = {}
        for shape, dtype in specs.values():
            sizes[np.dtype(dtype)] = sizes.get(np.dtype(dtype), 0) + int(np.prod(shape, dtype=np.int64))
        for dtype, size in sizes.items():
            self.buffers[dtype] = np.zeros(size, dtype)
        offsets = dict.fromkeys(self.buffers, 0)
        for name, (shape, dtype) in specs.items():
            dtype = np.dtype(dtype)
            n = int(np.prod(shape, dtype=np.int64))
            run = self.buffers[dtype][offsets[dtype] : offsets[dtype] + n]
            self.views[name] = run.reshape(shape[::-1]).T if name in self.transposed else run.reshape(shape)
            offsets[dtype] += n

    def like(self) -> FlatBuffers:
        return FlatBuffers(self.specs, self.transposed)

    def flat(self) -> np.ndarray:
        """All values in name order, each row-major, as one array (a copy when there are several
        dtypes or transposed matrices)."""
        if len(self.buffers) == 1 and not self.transposed:
            return next(iter(self.buffers.values()))
        return np.concatenate([self.views[n].ravel() for n in self.names]) if self.names else np.zeros(0, np.float32)

    @property
    def size(self) -> int:
        return sum(b.size for b in self.buffers.values())


@dataclass(frozen=True, slots=True)
class CompiledStep:
    """One artifact graph compiled for ``Module.__call__``: the plan, the data inputs the
    user feeds (user inputs, then labels) and how many of the plan's outputs are the user's
    (the loss and the extra outputs; a training plan's gradients and buffer updates follow)."""

    plan: Plan
    inputs: tuple[ValueSpec, ...]
    n_outputs: int


@dataclass(eq=False)
class TrainingState:
    """The training state a CheckpointState, the Module bound to it, its Optimizer and their
    schedulers share. Before a Module binds it, only ``checkpoint`` and ``source`` are set."""

    checkpoint: Checkpoint
    source: str  # where the checkpoint came from, for messages
    roles: meta.ArtifactInfo | None = None  # the bound training model's inputs and outputs by role
    params: FlatBuffers = field(default_factory=lambda: FlatBuffers({}))  # trainable parameters
    frozen: FlatBuffers = field(default_factory=lambda: FlatBuffers({}))  # frozen parameters
    grads: FlatBuffers = field(default_factory=lambda: FlatBuffers({}))  # accumulated gradients, params' layout
    buffers: dict[str, np.ndarray] = field(default_factory=dict)  # e.g. BatchNormalization running statistics
    rng: np.random.Generator | None = None  # the bound Module's generator (Dropout masks)

    @property
    def optimizer(self) -> OptimizerState | None:
        """The optimizer's step, learning rates and moments (set once an Optimizer exists)."""
        return self.checkpoint.optimizer

    def bind(self, roles: meta.ArtifactInfo, specs: dict[str, tuple[tuple[int, ...], np.dtype]], transposed: frozenset[str],
             rng: np.random.Generator, model_source: str) -> None:
        """Lay the checkpoint's parameters out in flat buffers for the training model described by
        ``roles`` (``specs``: shape and dtype of each parameter and buffer) and make its arrays
        views into them; restore the saved generator state into ``rng``."""
        ckpt = self.checkpoint
        check_matches(ckpt, specs, f"{self.source} for {model_source}")
        wrong = [n for n in roles.trainable if not ckpt.requires_grad.get(n, False)]
        if wrong:
            raise CheckpointError(f"{self.source}: {wrong} are trainable in the artifacts but frozen in the checkpoint")
        params = FlatBuffers({n: specs[n] for n in roles.trainable}, transposed)
        frozen = FlatBuffers({n: specs[n] for n in roles.frozen}, transposed)
        grads = params.like()
        for n in roles.buffers:  # onnxblock.save_checkpoint stores running statistics among the frozen parameters
            if n not in ckpt.buffers and n in ckpt.parameters:
                ckpt.buffers[n] = ckpt.parameters.pop(n)
                ckpt.requires_grad.pop(n, None)
        buffers = {n: np.array(ckpt.buffers[n], dtype=specs[n][1]) for n in roles.buffers}
        unloaded_buffers = sorted(n for n in roles.buffers if n in ckpt.missing)
        if unloaded_buffers:
            raise CheckpointError(f"{self.source}: the nominal checkpoint has no values for the buffers {unloaded_buffers} "
                                  "(an earlier version left them out); generate the nominal checkpoint again")
        for flat in (params, frozen):
            for name, view in flat.views.items():
                if name not in ckpt.missing:
                    np.copyto(view, ckpt.parameters[name])
                ckpt.parameters[name] = view
        for name, array in buffers.items():
            ckpt.buffers[name] = array
        self.roles, self.params, self.frozen, self.grads, self.buffers, self.rng = roles, params, frozen, grads, buffers, rng
        if ENGINE_RNG in ckpt.engine:
            rng.bit_generator.state = json.loads(ckpt.engine[ENGINE_RNG])

    def sync(self) -> None:
        """Record what lives outside the arrays (the generator) in the checkpoint's engine section."""
        if self.rng is not None:
            self.checkpoint.engine[ENGINE_RNG] = json.dumps(self.rng.bit_generator.state)

    def require_loaded(self) -> None:
        """Raise unless every parameter holds values (a nominal checkpoint's must be copied in)."""
        if self.checkpoint.missing:
            raise CheckpointError(
                f"{NOMINAL_NOT_LOADED} {self.source} is a nominal checkpoint and {sorted(self.checkpoint.missing)[:8]} "
                "have no values: call module.copy_buffer_to_parameters(buffer, trainable_only=False) with the weights"
            )
