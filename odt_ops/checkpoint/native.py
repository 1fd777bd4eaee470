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
from odt_ops.tensorfile import read_tensor_file, write_tensor_file

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
        ckpt.optimizer = OptimizerState(int(opt["step"]), float(opt["learning_rate"]), float(opt["initial_learning_rate"]))
    for entry, array in tensors:
        name, kind = entry["name"], entry.get("kind")
        if "spec" in entry:
            ckpt.specs[name] = (tuple(entry["spec"]["shape"]), np.dtype(entry["spec"]["dtype"]).str)
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
