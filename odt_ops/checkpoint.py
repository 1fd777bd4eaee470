"""The checkpoint: one file holding everything training needs to resume exactly.

Format (version 1): an uncompressed zip (numpy's .npz) whose members are plain .npy
arrays named t0, t1, ... plus ``manifest.json``, which maps them to parameter,
buffer and optimizer-state names and carries the optimizer's scalars and the
property bag. It is safe to load from an untrusted source (no pickle: object arrays
are refused), every member is CRC-checked on load, and tensors are memory-mapped
straight out of the file, so loading never holds every tensor in memory at once.
Writes are atomic (temp file, fsync, rename).
"""
from __future__ import annotations

import json
import os
import struct
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from odt_ops.errors import CheckpointError
from odt_ops.io import atomic_writer

FORMAT = "odt-checkpoint"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"

Property = int | float | str


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

    A nominal checkpoint has names, shapes and dtypes only: its arrays are zero-size
    placeholders described by ``specs`` and must be filled (copy_buffer_to_parameters)
    before training.
    """

    parameters: dict[str, np.ndarray] = field(default_factory=dict)
    requires_grad: dict[str, bool] = field(default_factory=dict)
    buffers: dict[str, np.ndarray] = field(default_factory=dict)
    optimizer: OptimizerState | None = None
    properties: dict[str, Property] = field(default_factory=dict)
    nominal: bool = False
    specs: dict[str, tuple[tuple[int, ...], str]] = field(default_factory=dict)  # nominal only

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


def save_checkpoint(checkpoint: Checkpoint, path: str | os.PathLike, *, include_optimizer_state: bool = True) -> None:
    """Write ``checkpoint`` to ``path`` atomically."""
    _check_properties(checkpoint.properties, str(path))
    tensors: list[tuple[str, dict, np.ndarray]] = []
    for name, array in checkpoint.parameters.items():
        tensors.append((name, {"kind": "parameter", "requires_grad": bool(checkpoint.requires_grad.get(name, False))}, array))
    for name, array in checkpoint.buffers.items():
        tensors.append((name, {"kind": "buffer"}, array))
    optimizer = None
    if include_optimizer_state and checkpoint.optimizer is not None:
        opt = checkpoint.optimizer
        optimizer = {"step": int(opt.step), "learning_rate": float(opt.learning_rate), "initial_learning_rate": float(opt.initial_learning_rate)}
        for param, states in opt.states.items():
            for state, array in states.items():
                tensors.append((param, {"kind": "optimizer", "state": state}, array))
    entries = []
    with atomic_writer(path) as out, zipfile.ZipFile(out, "w", compression=zipfile.ZIP_STORED, allowZip64=True) as zf:
        for i, (name, meta, array) in enumerate(tensors):
            key = f"t{i}"
            if checkpoint.nominal:
                shape, dtype = checkpoint.spec(name) if meta["kind"] != "optimizer" else (array.shape, array.dtype)
                array = np.zeros(0, dtype=dtype)
            else:
                array = np.ascontiguousarray(array)
                shape, dtype = array.shape, array.dtype
            if array.dtype.hasobject:
                raise CheckpointError(f"{path}: tensor {name!r} has dtype object; checkpoints hold numeric arrays only")
            entries.append({"key": key, "name": name, "shape": list(shape), "dtype": np.dtype(dtype).str, **meta})
            with zf.open(f"{key}.npy", "w", force_zip64=array.nbytes > 2**31) as f:
                np.lib.format.write_array(f, array, allow_pickle=False)
        manifest = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "nominal": checkpoint.nominal,
            "tensors": entries,
            "optimizer": optimizer,
            "properties": checkpoint.properties,
        }
        zf.writestr(MANIFEST, json.dumps(manifest, indent=1))


def load_checkpoint(path: str | os.PathLike) -> Checkpoint:
    """Read a checkpoint, verifying every member; tensors are memory-mapped read-only."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: no such checkpoint file")
    try:
        with zipfile.ZipFile(path) as zf:
            bad = zf.testzip()  # streams every member through its CRC, in constant memory
            if bad is not None:
                raise CheckpointError(f"{path}: member {bad} is corrupted (CRC mismatch); the checkpoint cannot be trusted")
            manifest = json.loads(zf.read(MANIFEST))
            infos = {i.filename: i for i in zf.infolist()}
    except (zipfile.BadZipFile, KeyError, OSError, EOFError, ValueError, struct.error) as exc:
        raise CheckpointError(f"{path}: not a readable ODT checkpoint (truncated or corrupted?): {exc}") from None
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"{path}: not an ODT checkpoint (format {manifest.get('format')!r})")
    version = manifest.get("format_version")
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise CheckpointError(f"{path}: checkpoint format version {version} is newer than this odt_ops reads ({FORMAT_VERSION}); upgrade odt")
    ckpt = Checkpoint(properties=dict(manifest.get("properties") or {}), nominal=bool(manifest.get("nominal")))
    _check_properties(ckpt.properties, str(path))
    opt = manifest.get("optimizer")
    if opt is not None:
        ckpt.optimizer = OptimizerState(int(opt["step"]), float(opt["learning_rate"]), float(opt["initial_learning_rate"]))
    for entry in manifest["tensors"]:
        info = infos.get(f"{entry['key']}.npy")
        if info is None:
            raise CheckpointError(f"{path}: tensor {entry['name']!r} is listed but missing from the file")
        array = _map_member(path, info, entry)
        name = entry["name"]
        if ckpt.nominal and entry["kind"] != "optimizer":
            ckpt.specs[name] = (tuple(entry["shape"]), np.dtype(entry["dtype"]).str)
        if entry["kind"] == "parameter":
            ckpt.parameters[name] = array
            ckpt.requires_grad[name] = bool(entry["requires_grad"])
        elif entry["kind"] == "buffer":
            ckpt.buffers[name] = array
        elif entry["kind"] == "optimizer":
            if ckpt.optimizer is None:
                raise CheckpointError(f"{path}: optimizer tensor for {name!r} without optimizer scalars")
            ckpt.optimizer.states.setdefault(name, {})[entry["state"]] = array
        else:
            raise CheckpointError(f"{path}: tensor {name!r} has unknown kind {entry['kind']!r}")
    return ckpt


def _map_member(path: Path, info: zipfile.ZipInfo, entry: Mapping) -> np.ndarray:
    """Memory-map one stored .npy member: its bytes sit uncompressed inside the zip."""
    if info.compress_type != zipfile.ZIP_STORED:
        raise CheckpointError(f"{path}: tensor {entry['name']!r} is compressed; ODT checkpoints store tensors uncompressed")
    with open(path, "rb") as f:
        f.seek(info.header_offset)
        local = f.read(30)
        if local[:4] != b"PK\x03\x04":
            raise CheckpointError(f"{path}: tensor {entry['name']!r}: bad zip local header")
        name_len, extra_len = struct.unpack("<HH", local[26:30])
        f.seek(info.header_offset + 30 + name_len + extra_len)
        try:
            version = np.lib.format.read_magic(f)
            read_header = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
            shape, fortran, dtype = read_header(f)
        except ValueError as exc:
            raise CheckpointError(f"{path}: tensor {entry['name']!r}: bad array header: {exc}") from None
        offset = f.tell()
    if dtype.hasobject:
        raise CheckpointError(f"{path}: tensor {entry['name']!r} holds Python objects; refusing to load (no pickle)")
    if list(shape) != [0] and (list(shape) != list(entry["shape"]) or dtype != np.dtype(entry["dtype"])):
        raise CheckpointError(f"{path}: tensor {entry['name']!r}: stored {dtype}{list(shape)} disagrees with the manifest")
    if int(np.prod(shape)) == 0:
        return np.zeros(shape, dtype)
    return np.memmap(path, dtype=dtype, mode="r", offset=offset, shape=tuple(shape), order="F" if fortran else "C")


def _check_properties(properties: Mapping[str, object], where: str) -> None:
    for key, value in properties.items():
        if not isinstance(key, str) or isinstance(value, bool) or not isinstance(value, (int, float, str)):
            raise CheckpointError(f"{where}: property {key!r} = {value!r}: properties must be int, float or str")


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
