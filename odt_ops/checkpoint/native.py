"""Our checkpoint format (version 1): a tensor file (see ``tensorfile``: uncompressed npz + JSON
manifest, CRC-checked, memory-mapped, no pickle, atomic writes) whose manifest maps tensors to
parameter, buffer and optimizer-state names and carries the optimizer's scalars, the property bag
(the user's alone) and the engine's own state (the Dropout generator), kept apart so user code
that walks the properties sees only its own.
"""
from __future__ import annotations

import json
import os
from collections.abc import Mapping

import numpy as np

from odt_ops.checkpoint.state import ENGINE_RNG, LEGACY_ENGINE_PROPERTIES, Checkpoint, OptimizerState
from odt_ops.errors import CheckpointError, OdtError
from odt_ops.scalars import as_real, finite_at_least_zero
from odt_ops.tensorfile import checked_shape, numeric_dtype, read_tensor_file, write_tensor_file

FORMAT = "odt-checkpoint"
FORMAT_VERSION = 1


def save_checkpoint(checkpoint: Checkpoint, path: str | os.PathLike, *, include_optimizer_state: bool = True) -> None:
    """Write ``checkpoint`` to ``path`` atomically."""
    _check_properties(checkpoint.properties, str(path))
    filled = [n for n in checkpoint.parameters if n not in checkpoint.missing]
    if checkpoint.missing and filled:  # a nominal file would drop the filled values, a full one would hold zeros
        raise CheckpointError(
            f"{path}: not saved: {sorted(checkpoint.missing)} still have no values while {filled} do. Fill every "
            "parameter first (module.copy_buffer_to_parameters(buffer, trainable_only=False))"
        )

    def tensor(name: str, meta: dict, array: np.ndarray) -> tuple[dict, np.ndarray]:
        entry = {"name": name, **meta}
        if name in checkpoint.missing and meta["kind"] != "optimizer":
            shape, dtype = checkpoint.spec(name)
            entry["spec"] = {"shape": list(shape), "dtype": np.dtype(dtype).str}
            array = np.zeros(0, dtype=dtype)
        return entry, array

    tensors = [tensor(n, {"kind": "parameter", "requires_grad": bool(checkpoint.requires_grad.get(n, False))}, a)
               for n, a in checkpoint.parameters.items()]
    tensors += [tensor(n, {"kind": "buffer"}, a) for n, a in checkpoint.buffers.items()]
    optimizer = None
    if include_optimizer_state and checkpoint.optimizer is not None:
        opt = checkpoint.optimizer
        optimizer = {"step": int(opt.step), "learning_rate": float(opt.learning_rate), "initial_learning_rate": float(opt.initial_learning_rate)}
        tensors += [({"name": p, "kind": "optimizer", "state": s}, a) for p, states in opt.states.items() for s, a in states.items()]
    header = {"nominal": checkpoint.nominal, "optimizer": optimizer, "properties": checkpoint.properties,
              "engine": checkpoint.engine}
    write_tensor_file(path, FORMAT, FORMAT_VERSION, header, tensors, CheckpointError)


def read_checkpoint(path: str | os.PathLike) -> Checkpoint:
    """Read a checkpoint of our format, verifying every member; tensors are memory-mapped read-only."""
    manifest, tensors = read_tensor_file(path, FORMAT, FORMAT_VERSION, CheckpointError, "checkpoint")
    try:
        return _from_manifest(manifest, tensors, path)
    except OdtError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError, OverflowError) as exc:  # a field of the wrong kind
        raise CheckpointError(f"{path}: the checkpoint's manifest is damaged ({type(exc).__name__}: {exc})") from None


def _from_manifest(manifest: dict, tensors: list, path) -> Checkpoint:
    ckpt = Checkpoint(properties=_mapping(manifest, "properties", path), engine=_mapping(manifest, "engine", path))
    _check_properties(ckpt.properties, str(path))
    _check_engine(ckpt.engine, str(path))
    for key, engine_key in LEGACY_ENGINE_PROPERTIES.items():  # files of earlier releases kept it among the user's
        if key in ckpt.properties:
            ckpt.engine.setdefault(engine_key, str(ckpt.properties.pop(key)))
    _check_rng_state(ckpt.engine, path)
    opt = manifest.get("optimizer")
    if opt is not None:
        ckpt.optimizer = _optimizer_scalars(opt, path)
    for entry, array in tensors:
        name, kind = entry["name"], entry.get("kind")
        if "spec" in entry:
            ckpt.specs[name] = _spec(entry["spec"], name, path)
            ckpt.missing.add(name)
        if kind == "parameter":
            ckpt.parameters[name] = array
            ckpt.requires_grad[name] = bool(entry.get("requires_grad"))
        elif kind == "buffer":
            ckpt.buffers[name] = array
        elif kind == "optimizer" and ckpt.optimizer is not None:
            ckpt.optimizer.states.setdefault(name, {})[entry["state"]] = array
        else:
            raise CheckpointError(f"{path}: tensor {name!r} has unexpected kind {kind!r}")
    if ckpt.optimizer is not None:
        _check_optimizer_states(ckpt, path)
    return ckpt


# a step count is stored as int64 wherever it is used (the optimizer model's step input)
MAX_STEP = 2**63 - 1


def _optimizer_scalars(opt: object, path) -> OptimizerState:
    """The optimizer's step and learning rates, as the Python API would accept them
    (odt_ops.api.optimizer.checked_learning_rate): a NaN, infinite or negative rate would make
    every parameter NaN (or climb the loss) at the first step, in silence."""
    if not isinstance(opt, dict):
        raise CheckpointError(f"{path}: the manifest's 'optimizer' is a {type(opt).__name__}, not a mapping; the file is damaged")
    step = opt.get("step")
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step <= MAX_STEP:
        raise CheckpointError(f"{path}: optimizer.step is {_shown(opt, 'step')}; a step count is an integer from 0 to "
                              "2**63 - 1: the file is damaged")
    rates = []
    for key in ("learning_rate", "initial_learning_rate"):
        rate = as_real(opt.get(key))
        if rate is None or not finite_at_least_zero(rate):
            raise CheckpointError(f"{path}: optimizer.{key} is {_shown(opt, key)}; a learning rate is a finite number "
                                  ">= 0 (the first step would turn every parameter NaN or climb the loss): the file is damaged")
        rates.append(rate)  # finite: checked just above
    return OptimizerState(step, rates[0], rates[1])


def _shown(mapping: Mapping, key: str) -> str:
    if key not in mapping:
        return "missing"
    text = repr(mapping[key])
    return text if len(text) <= 40 else text[:36] + "..."


def _spec(spec: object, name: str, path) -> tuple[tuple[int, ...], str]:
    """A nominal parameter's declared shape and dtype, checked before anything is made of that size."""
    dtype = numeric_dtype(spec.get("dtype")) if isinstance(spec, dict) else None
    if dtype is None or not isinstance(spec, dict):
        raise CheckpointError(f"{path}: parameter {name!r} has no values and its spec {str(spec)[:80]} names no numeric "
                              "dtype; the file is damaged")
    return checked_shape(spec.get("shape"), dtype, CheckpointError, f"{path}: parameter {name!r}"), dtype.str


def _check_optimizer_states(ckpt: Checkpoint, path) -> None:
    """Every optimizer state belongs to a parameter and has its shape and dtype (the optimizer
    keeps its moments in buffers laid out like the parameters)."""
    problems = []
    for name, states in ckpt.optimizer.states.items():
        if name not in ckpt.parameters:
            problems.append(f"{name}: optimizer state for something that is not a parameter of the checkpoint")
            continue
        shape, dtype = ckpt.spec(name)
        problems += [f"{name}: optimizer state {state!r} is {a.dtype}{list(a.shape)}, the parameter {dtype}{list(shape)}"
                     for state, a in states.items() if tuple(a.shape) != tuple(shape) or a.dtype != dtype]
    if problems:
        raise CheckpointError(f"{path}: the checkpoint's optimizer state is damaged:\n  " + "\n  ".join(problems))


def _check_rng_state(engine: Mapping[str, str], path) -> None:
    """The saved Dropout generator state must be one numpy's PCG64 (what Module draws from) accepts;
    it is restored only when a Module binds the checkpoint, so it is tried on a scratch generator now."""
    if ENGINE_RNG not in engine:
        return
    try:
        np.random.PCG64().state = json.loads(engine[ENGINE_RNG])
    except (ValueError, TypeError, KeyError, OverflowError, RecursionError, AttributeError) as exc:
        raise CheckpointError(f"{path}: the saved random generator state is damaged ({type(exc).__name__}: {str(exc)[:120]}); "
                              f"delete the engine's {ENGINE_RNG!r} entry to start from a fresh generator") from None


def _mapping(manifest: Mapping, key: str, path) -> dict:
    value = manifest.get(key) or {}
    if not isinstance(value, dict):
        raise CheckpointError(f"{path}: the manifest's {key!r} is a {type(value).__name__}, not a mapping; the file is damaged")
    return dict(value)


def _check_engine(engine: Mapping[str, object], where: str) -> None:
    bad = {k: v for k, v in engine.items() if not isinstance(k, str) or not isinstance(v, str)}
    if bad:
        raise CheckpointError(f"{where}: engine state {sorted(map(str, bad))} is not text; the file is damaged")


def _check_properties(properties: Mapping[str, object], where: str) -> None:
    for key, value in properties.items():
        if not isinstance(key, str) or isinstance(value, bool) or not isinstance(value, (int, float, str)):
            raise CheckpointError(f"{where}: property {key!r} = {value!r}: properties must be int, float or str")
