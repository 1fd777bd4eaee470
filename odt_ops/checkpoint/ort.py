"""Read ONNX Runtime's training checkpoint (onnxruntime-training 1.19 and earlier) as our Checkpoint.

ONNX Runtime writes a FlatBuffer with file identifier ``ODTC`` (schema
``ort_training_checkpoint.fbs``, Tensor from ``ort.fbs``)::

    Checkpoint     { version:int32; module_state:ModuleState; optimizer_groups:[OptimizerGroup];
                     property_bag:PropertyBag }
    ModuleState    { requires_grad_params:[Tensor]; frozen_params:[Tensor]; is_nominal_state:bool;
                     has_external_data:bool }
    OptimizerGroup { group_name:string; step:int64; initial_learning_rate:float;
                     optimizer_states:[ParameterOptimizerState] }
    ParameterOptimizerState { param_name:string; momentums:[Tensor] }
    PropertyBag    { ints:[IntProperty]; floats:[FloatProperty]; strings:[StringProperty] }
    Tensor         { name; doc_string; dims:[int64]; data_type:int32; raw_data:[uint8];
                     string_data:[string]; external_data_offset:int64 = -1 }

A tensor with ``external_data_offset >= 0`` keeps its bytes in ``<checkpoint>.data`` at
that offset (ONNX Runtime does this for checkpoints too large for one FlatBuffer).

ONNX Runtime saves the initial learning rate, not the current one, and resumes at the
initial one; so does the Checkpoint returned here. Its AdamW moments ``momentum0`` and
``momentum1`` get our AdamW's state names (ONNX Runtime's SGD keeps an unused ``momentum0``,
which keeps its name). Anything malformed raises CheckpointError
naming the file and the fault.
"""
from __future__ import annotations

import math
import os
import struct
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from odt_ops import confined
from odt_ops.checkpoint.flatbuffer import Buffer, Malformed, Table
from odt_ops.checkpoint.state import Checkpoint, OptimizerState
from odt_ops.errors import CheckpointError, OdtError
from odt_ops.tensorfile import checked_shape, open_input

IDENTIFIER = b"ODTC"
EXTERNAL_DATA_SUFFIX = ".data"
# the versions ONNX Runtime has written: 1, and 2 (is_nominal_state); external data came without a new version
KNOWN_VERSIONS = range(1, 3)

# ONNX Runtime's AdamWOptimizer state names -> our AdamW's (first and second moments, in that order;
# tests/odt_ops/test_ort_import.py holds them equal to odt_ops.onnxblock.optim.AdamW's state_names)
ORT_STATE_NAMES = {"momentum0": "exp_avg", "momentum1": "exp_avg_sq"}

# FlatBuffers' own limit (32-bit offsets): ONNX Runtime moves tensors into the .data file to stay
# below it, so no checkpoint file of its is larger; the file's size is checked before it is read
MAX_CHECKPOINT_BYTES = 2**31 - 1

# TensorProto data types that map to a numpy dtype (little-endian, as ONNX Runtime writes them)
_DTYPES = {1: "<f4", 2: "u1", 3: "i1", 4: "<u2", 5: "<i2", 6: "<i4", 7: "<i8", 9: "?", 10: "<f2", 11: "<f8",
           12: "<u4", 13: "<u8", 14: "<c8", 15: "<c16"}


def is_ort_checkpoint(path: str | os.PathLike) -> bool:
    """True when ``path`` is a regular file carrying ONNX Runtime's checkpoint identifier (a
    FIFO, a device or a folder is not: it is refused unread, never waited on)."""
    try:
        with open_input(path, CheckpointError, "checkpoint") as f:
            head = f.read(8)
    except (OdtError, OSError):
        return False
    return is_ort_header(head)


def is_ort_header(head: bytes) -> bool:
    """True when a file's first 8 bytes carry ONNX Runtime's checkpoint identifier."""
    return len(head) >= 8 and head[4:8] == IDENTIFIER


def read_ort_checkpoint(path: str | os.PathLike, shapes: Mapping[str, Sequence[int] | None] | None = None) -> Checkpoint:
    """Read an ONNX Runtime checkpoint file (and its ``.data`` file, when it has one).

    ONNX Runtime writes a nominal checkpoint's tensors without their shapes; ``shapes``
    (e.g. the static shapes of the eval model's parameter inputs) gives them. Without it a
    nominal parameter's spec has the shape the file records, which is ``()``.

    Only a regular file is read (a FIFO would block forever, /dev/zero never end), and only
    after its size is known to be one a FlatBuffer can have."""
    path = Path(path)
    if path.is_dir():
        raise CheckpointError(f"{path}: a directory; ONNX Runtime's checkpoint (1.14 and later) is one FlatBuffer file, "
                              "e.g. ARTIFACT_DIR/checkpoint (the protobuf directories of earlier releases are not read)")
    with open_input(path, CheckpointError, "ONNX Runtime checkpoint") as f:
        size = os.fstat(f.fileno()).st_size
        if size > MAX_CHECKPOINT_BYTES:
            raise CheckpointError(f"{path}: {size} bytes, more than an ONNX Runtime checkpoint can hold ({MAX_CHECKPOINT_BYTES}, "
                                  "FlatBuffers' limit; larger ones keep their tensors in a .data file); refused unread")
        try:
            data = f.read(size)
        except OSError as exc:
            raise CheckpointError(f"{path}: cannot read the ONNX Runtime checkpoint: {exc.strerror or exc}") from None
    return parse_ort_checkpoint(data, str(path), external_data=path.with_name(path.name + EXTERNAL_DATA_SUFFIX), shapes=shapes)


def parse_ort_checkpoint(data: bytes, source: str = "<ONNX Runtime checkpoint>", external_data: str | os.PathLike | None = None,
                         shapes: Mapping[str, Sequence[int] | None] | None = None) -> Checkpoint:
    """Parse checkpoint bytes; ``source`` names them in errors, ``external_data`` is the
    file holding the bytes of tensors stored outside the FlatBuffer."""
    reader = _Reader(source, external_data)
    try:
        ckpt = reader.checkpoint(Buffer(data))
    except CheckpointError:  # already names the file and the fault (e.g. a refused .data file); said once
        raise
    except Malformed as exc:
        raise CheckpointError(f"{source}: not a valid ONNX Runtime checkpoint: {exc}") from None
    except (struct.error, IndexError, ValueError, OverflowError, UnicodeDecodeError) as exc:  # a check this reader lacks
        raise CheckpointError(f"{source}: not a valid ONNX Runtime checkpoint: {type(exc).__name__}: {exc}") from None
    finally:
        reader.close()
    for name in ckpt.missing:
        shape = (shapes or {}).get(name)
        if shape is not None and ckpt.specs[name][0] == ():  # the file's own shape, where it has one, stands
            dtype = np.dtype(ckpt.specs[name][1])
            where = f"{source}: parameter {name!r} (its shape from the eval model)"
            ckpt.specs[name] = (checked_shape(tuple(shape), dtype, CheckpointError, where), dtype.str)
    return ckpt


class _Reader:
    """One checkpoint's reading: the source name for errors and the lazily opened external data."""

    def __init__(self, source: str, external_data: str | os.PathLike | None):
        self.source = source
        self.external_path = external_data
        self._external = None

    def close(self) -> None:
        if self._external is not None:
            self._external.close()

    def checkpoint(self, buf: Buffer) -> Checkpoint:
        ident = buf.identifier()
        if ident != IDENTIFIER:
            raise Malformed(f"file identifier {ident!r}, expected {IDENTIFIER!r}")
        root = buf.root()
        version = root.i32(0, "version")
        if version not in KNOWN_VERSIONS:
            newer = version > KNOWN_VERSIONS[-1]
            raise Malformed(f"checkpoint version {version} is {'newer than' if newer else 'not one of'} the versions this "
                            f"reader knows ({KNOWN_VERSIONS[0]}..{KNOWN_VERSIONS[-1]}, onnxruntime-training up to 1.19)")
        ckpt = Checkpoint()
        module = root.table(1, "module_state")
        if module is not None:
            self.module_state(module, ckpt)
        groups = root.tables(2, "optimizer_groups") or []
        if len(groups) > 1:
            names = [g.string(0, "group_name") for g in groups]
            raise Malformed(f"{len(groups)} optimizer groups {names}; odt_ops trains with one")
        if groups:
            ckpt.optimizer = self.optimizer_group(groups[0], ckpt)
        bag = root.table(3, "property_bag")
        if bag is not None:
            ckpt.properties = self.properties(bag)
        return ckpt

    def module_state(self, table: Table, ckpt: Checkpoint) -> None:
        nominal = table.bool(2, "is_nominal_state")
        for index, field, trainable in ((0, "requires_grad_params", True), (1, "frozen_params", False)):
            for tensor in table.tables(index, field) or []:
                name, array, spec = self.tensor(tensor, nominal)
                if name in ckpt.parameters:
                    raise Malformed(f"parameter {name!r} appears twice")
                ckpt.parameters[name] = array
                ckpt.requires_grad[name] = trainable
                if spec is not None:
                    ckpt.specs[name] = spec
                    ckpt.missing.add(name)

    def optimizer_group(self, group: Table, ckpt: Checkpoint) -> OptimizerState:
        # as the Python API refuses them (checked_learning_rate): training from a NaN, infinite or
        # negative rate would turn every parameter NaN (or climb the loss) at the first step
        step = group.i64(1, "step")
        if step < 0:
            raise Malformed(f"the optimizer group's step is {step}; a step count is >= 0")
        lr = group.f32(2, "initial_learning_rate")
        if not math.isfinite(lr) or lr < 0:
            raise Malformed(f"the optimizer group's initial_learning_rate is {lr}; a learning rate is a finite number >= 0")
        state = OptimizerState(step=step, learning_rate=lr, initial_learning_rate=lr)
        for entry in group.tables(3, "optimizer_states") or []:
            param = entry.string(0, "param_name")
            if param is None:
                raise Malformed(f"{entry.what} has no param_name")
            if param in state.states:
                raise Malformed(f"optimizer state of {param!r} appears twice")
            if ckpt.parameters and param not in ckpt.parameters:
                raise Malformed(f"optimizer state for {param!r}, which is not a parameter of the checkpoint")
            moments = state.states[param] = {}
            tensors = [self.tensor(tensor, nominal=False)[:2] for tensor in entry.tables(1, "momentums") or []]
            # AdamW's pair gets our AdamW's names; a lone momentum0 is the one ONNX Runtime keeps
            # (unused) for SGD and keeps its name
            adamw = set(ORT_STATE_NAMES) <= {name for name, _ in tensors}
            for name, array in tensors:
                ours = ORT_STATE_NAMES.get(name, name) if adamw else name
                if ours in moments:
                    raise Malformed(f"optimizer state {name!r} of {param!r} appears twice")
                shape = ckpt.spec(param)[0] if param in ckpt.parameters else array.shape
                if array.shape != tuple(shape):
                    raise Malformed(f"optimizer state {name!r} of {param!r} has shape {list(array.shape)}, "
                                    f"the parameter {list(shape)}")
                moments[ours] = array
        return state

    def properties(self, bag: Table) -> dict[str, int | float | str]:
        props: dict[str, int | float | str] = {}
        for index, field, read in ((0, "ints", lambda t: t.i64(1, "value")), (1, "floats", lambda t: t.f32(1, "value")),
                                   (2, "strings", lambda t: t.string(1, "value"))):
            for prop in bag.tables(index, field) or []:
                name = prop.string(0, "name")
                if name is None:
                    raise Malformed(f"{prop.what} has no name")
                value = read(prop)
                if value is None:
                    raise Malformed(f"string property {name!r} has no value")
                if name in props:
                    raise Malformed(f"property {name!r} appears twice")
                props[name] = value
        return props

    def tensor(self, t: Table, nominal: bool) -> tuple[str, np.ndarray, tuple[tuple[int, ...], str] | None]:
        """(name, values, spec): a nominal tensor's values are a zero-size placeholder and
        its spec (shape, dtype) says what it will hold."""
        name = t.string(0, "name")
        if not name:
            raise Malformed(f"{t.what} has no name")
        dims = t.int64s(2, "dims")
        if dims is None:
            raise Malformed(f"tensor {name!r} has no dims")
        if any(d < 0 for d in dims):
            raise Malformed(f"tensor {name!r} has negative dims {dims}")
        code = t.i32(3, "data_type")
        if code not in _DTYPES:
            raise Malformed(f"tensor {name!r} has data type {code}, which odt_ops cannot hold (numeric types only)")
        dtype = np.dtype(_DTYPES[code])
        shape = checked_shape(dims, dtype, Malformed, f"tensor {name!r}")
        nbytes = math.prod(shape) * dtype.itemsize
        raw = t.bytes(4, "raw_data")
        offset = t.i64(6, "external_data_offset", -1)
        if nominal:
            if raw is not None and len(raw) not in (0, nbytes):
                raise Malformed(f"nominal tensor {name!r} holds {len(raw)} bytes; {dtype}{list(shape)} takes {nbytes}")
            return name, np.zeros(0, dtype), (shape, dtype.str)
        if raw is not None and (len(raw) or offset < 0):
            if len(raw) != nbytes:
                raise Malformed(f"tensor {name!r} holds {len(raw)} bytes; {dtype}{list(shape)} takes {nbytes}")
            data = raw
        elif offset >= 0:
            data = self.external(name, offset, nbytes)
        else:
            raise Malformed(f"tensor {name!r} has neither raw data nor an external data offset")
        array = np.frombuffer(data, dtype=dtype, count=math.prod(shape)).reshape(shape).astype(dtype.newbyteorder("="))
        return name, array, None

    def external(self, name: str, offset: int, nbytes: int) -> bytes:
        if self.external_path is None:
            raise Malformed(f"tensor {name!r} is stored in an external data file, and none was given")
        if self._external is None:
            # the .data file beside the checkpoint, and only if it really is there: a symlink leading
            # out of the folder, a directory or a device is refused
            where = Path(self.external_path)
            what = f"{self.source}: tensor {name!r} is stored in the external data file {where}"
            self._external = confined.open_regular(confined.resolve_inside(where.parent, where.name, CheckpointError, what),
                                                   CheckpointError, what)
        size = os.fstat(self._external.fileno()).st_size
        if offset + nbytes > size:
            raise Malformed(f"tensor {name!r}: bytes {offset}..{offset + nbytes} lie past the end of {self.external_path} "
                            f"({size} bytes)")
        self._external.seek(offset)
        return self._external.read(nbytes)
