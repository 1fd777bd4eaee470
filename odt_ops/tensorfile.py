"""The container behind checkpoints and model differences: tensors plus a JSON manifest.

An uncompressed zip (numpy's .npz layout) whose members are plain .npy arrays named
t0, t1, ... and ``manifest.json``. Safe to load from an untrusted source: no pickle
(object arrays are refused on write and on read), every member is CRC-checked on
load in constant memory, and tensors are memory-mapped straight out of the file, so
loading never holds every tensor in memory at once. Writes are atomic.
"""
from __future__ import annotations

import json
import math
import os
import stat
import struct
import zipfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from odt_ops.confined import file_kind
from odt_ops.errors import OdtError, not_found
from odt_ops.io import atomic_writer

MANIFEST = "manifest.json"


def write_tensor_file(path: str | os.PathLike, fmt: str, version: int, header: dict[str, Any],
                      tensors: Iterable[tuple[dict[str, Any], np.ndarray]], error: type[OdtError]) -> None:
    """Write tensors (each with its manifest entry) and ``header`` to ``path`` atomically."""
    entries = []
    with atomic_writer(path) as out, zipfile.ZipFile(out, "w", compression=zipfile.ZIP_STORED, allowZip64=True) as zf:
        for i, (entry, array) in enumerate(tensors):
            array = np.asarray(array)
            if array.dtype.hasobject:
                raise error(f"{path}: tensor {entry.get('name')!r} has dtype object; only numeric arrays are stored")
            key = f"t{i}"
            with zf.open(_member(f"{key}.npy"), "w", force_zip64=array.nbytes > 2**31) as f:
                # not np.ascontiguousarray: it turns a 0-d array (a scalar parameter) into shape [1]
                np.lib.format.write_array(f, np.array(array, order="C", copy=not array.flags.c_contiguous), allow_pickle=False)
            entries.append({"key": key, "shape": list(array.shape), "dtype": array.dtype.str, **entry})
        manifest = {"format": fmt, "format_version": version, **header, "tensors": entries}
        zf.writestr(_member(MANIFEST), json.dumps(manifest, indent=1))


def _member(name: str) -> zipfile.ZipInfo:
    """A member with a fixed date, so the same tensors always make the same bytes (DVC
    compares outputs by hash; a timestamp would make every rerun look like a change)."""
    return zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))


# A manifest names tensors and a few scalars: ~150 bytes a tensor, so this is far beyond any real
# one, and keeps a hostile one from costing more than a moment and some tens of MiB to parse.
MAX_MANIFEST_BYTES = 16 << 20
MAX_NPY_HEADER = 4096  # a numeric array's header takes ~128 bytes (numpy's own limit is 10,000)
_LOCAL_HEADER = 30  # bytes of a zip local file header before its name and extra field
# A declared shape is checked before anything is allocated or mapped for it: numpy refuses more
# dimensions than 32 (numpy 1; 64 in numpy 2) and a shape whose dimensions multiply past its
# address space even when one of them is 0 (np.zeros((0, 2**63 - 1)) raises). No tensor a model
# or a checkpoint really holds comes near these bounds.
MAX_NDIM = 32
MAX_TENSOR_BYTES = 1 << 40  # 1 TiB: the dimensions' product (a 0 counted as 1) times the item size


def checked_shape(shape: object, dtype: np.dtype, error: type[Exception], where: str) -> tuple[int, ...]:
    """``shape`` as a tuple of ints, or ``error`` naming ``where`` unless every dimension is a
    non-negative integer, there are at most MAX_NDIM of them, and they multiply (a 0 counted as 1,
    so an empty tensor is held to the bound it would have with data) to at most MAX_TENSOR_BYTES
    of ``dtype``. Call it before any np.zeros, np.memmap or reshape of a declared shape."""
    dims = list(shape) if isinstance(shape, (list, tuple)) else None
    if dims is None or not all(isinstance(d, (int, np.integer)) and not isinstance(d, (bool, np.bool_)) for d in dims):
        raise error(f"{where}: shape {_shape_text(shape)} is not a list of integers; the file is damaged")
    if any(d < 0 for d in dims):
        raise error(f"{where}: shape {_shape_text(dims)} has a negative dimension; the file is damaged")
    if len(dims) > MAX_NDIM:
        raise error(f"{where}: shape has {len(dims)} dimensions, more than the {MAX_NDIM} numpy holds; the file is damaged")
    span = math.prod(max(int(d), 1) for d in dims) * max(dtype.itemsize, 1)
    if span > MAX_TENSOR_BYTES:
        empty = " (it holds no values, yet numpy cannot even make it empty)" if 0 in dims else ""
        raise error(f"{where}: shape {_shape_text(dims)} of {dtype} spans more than 2**{MAX_TENSOR_BYTES.bit_length() - 1} "
                    f"bytes{empty}; no real tensor is that large: the file is damaged")
    return tuple(int(d) for d in dims)


def _shape_text(shape: object) -> str:
    """A declared shape for a message, short whatever it holds (2**64-digit dimensions included)."""
    if not isinstance(shape, (list, tuple)):
        return repr(shape)[:60]
    def dim(d: object) -> str:
        if isinstance(d, (int, np.integer)) and not isinstance(d, bool) and abs(int(d)) >= 10**20:
            return f"{'-' if d < 0 else ''}~2**{abs(int(d)).bit_length() - 1}"
        return repr(d)[:24]
    text = ", ".join(dim(d) for d in shape[:8])
    return f"[{text}{', ...' if len(shape) > 8 else ''}]"


def open_input(path: str | os.PathLike, error: type[OdtError], what: str) -> BinaryIO:
    """``path``, a file the user named, opened for reading; a typed error naming it when it is
    missing, a folder, or not a regular file (a FIFO would block the read forever, a device such
    as /dev/zero never end it). A symlink is followed, to a regular file only. Checked on the
    opened descriptor: nothing can be swapped in between."""
    shown = os.fspath(path)
    if os.path.isdir(path):
        raise error(f"{shown}: a folder, not a {what} file; name the {what} file in it")
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except FileNotFoundError:
        raise not_found(error)(f"{shown}: no such {what} file") from None
    except OSError as exc:
        raise error(f"{shown}: cannot open the {what}: {exc.strerror or exc}") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        kind = file_kind(mode)
        raise error(f"{shown}: {kind}, not a regular file: refused unread; give the path of the {what} file itself"
                    if kind != "a folder" else f"{shown}: a folder, not a {what} file; name the {what} file in it")
    return os.fdopen(fd, "rb")


def read_tensor_file(path: str | os.PathLike, fmt: str, version: int, error: type[OdtError], what: str) -> tuple[dict, list[tuple[dict, np.ndarray]]]:
    """The manifest and (entry, memory-mapped array) pairs of a file written above.

    Nothing is inflated or read before the zip's directory has been checked: a compressed member
    (a deflate bomb), a member whose sizes disagree or lie past the end of the file, and an
    oversized manifest are refused first; each tensor's declared size is checked against its
    member before it is mapped."""
    path = Path(path)
    with open_input(path, error, what) as f:
        manifest, infos = _read_directory(path, f, error, what)
        if not isinstance(manifest, dict) or manifest.get("format") != fmt:
            raise error(f"{path}: not an ODT {what} (format {manifest.get('format') if isinstance(manifest, dict) else None!r})")
        found = manifest.get("format_version")
        if not isinstance(found, int) or found > version:
            raise error(f"{path}: {what} format version {found} is newer than this odt_ops reads ({version}); upgrade odt")
        entries = manifest.get("tensors", [])
        if not isinstance(entries, list) or not all(_valid_entry(e) for e in entries):
            raise error(f"{path}: the {what}'s manifest lists its tensors wrongly (each needs a str key and name, an "
                        "int shape and a numeric dtype); the file is damaged")
        tensors = []
        for entry in entries:
            info = infos.get(f"{entry.get('key')}.npy")
            if info is None:
                raise error(f"{path}: tensor {entry.get('name')!r} is listed but missing from the file")
            tensors.append((entry, _map_member(path, f, info, entry, error)))
    return manifest, tensors


def _read_directory(path: Path, f: BinaryIO, error: type[OdtError], what: str) -> tuple[Any, dict[str, zipfile.ZipInfo]]:
    """The parsed manifest and the checked members of the zip open as ``f``."""
    try:
        with zipfile.ZipFile(f) as zf:
            infos = _checked_members(path, zf.infolist(), os.fstat(f.fileno()).st_size, error, what)
            bad = zf.testzip()  # streams every member through its CRC, in constant memory
            if bad is not None:
                raise error(f"{path}: member {bad} is corrupted (CRC mismatch); the {what} cannot be trusted")
            return json.loads(zf.read(MANIFEST)), infos
    except OdtError:
        raise
    except (zipfile.BadZipFile, KeyError, OSError, EOFError, ValueError, struct.error, NotImplementedError, RuntimeError,
            OverflowError) as exc:
        # NotImplementedError and RuntimeError: zipfile's answers to a compression method, version or
        # encryption flag it does not know; ValueError includes a manifest that is not UTF-8 JSON;
        # RecursionError (a RuntimeError): JSON nested deeper than the parser goes
        raise error(f"{path}: not a readable ODT {what} (truncated or corrupted?): {type(exc).__name__}: {str(exc)[:200]}") from None


def _checked_members(path: Path, infos: list[zipfile.ZipInfo], file_size: int, error: type[OdtError],
                     what: str) -> dict[str, zipfile.ZipInfo]:
    """Name -> member, after refusing what must not be read: compressed members (they could
    inflate to gigabytes), sizes that disagree or run past the end of the file, duplicate names
    and an oversized manifest. Only the zip's directory has been read so far."""
    members: dict[str, zipfile.ZipInfo] = {}
    for info in infos:
        name = info.filename
        if info.compress_type != zipfile.ZIP_STORED:
            raise error(f"{path}: member {name!r} is compressed (method {info.compress_type}); ODT {what} files store every "
                        "member uncompressed, so it is refused unread")
        if info.file_size != info.compress_size or info.header_offset + _LOCAL_HEADER + info.file_size > file_size:
            raise error(f"{path}: member {name!r} declares {info.file_size} bytes ({info.compress_size} stored) at byte "
                        f"{info.header_offset} of a {file_size}-byte file; the file is damaged")
        if name in members:
            raise error(f"{path}: member {name!r} appears twice; the file is damaged")
        members[name] = info
    manifest = members.get(MANIFEST)
    if manifest is None:
        raise error(f"{path}: no {MANIFEST} member; not an ODT {what} (truncated or corrupted?)")
    if manifest.file_size > MAX_MANIFEST_BYTES:
        raise error(f"{path}: its {MANIFEST} takes {manifest.file_size} bytes, more than any {what} needs "
                    f"({MAX_MANIFEST_BYTES}); refused unread")
    return members


def _valid_entry(entry: object) -> bool:
    if not isinstance(entry, dict) or not isinstance(entry.get("key"), str) or not isinstance(entry.get("name"), str):
        return False
    shape = entry.get("shape")
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        return False
    return numeric_dtype(entry.get("dtype")) is not None


def numeric_dtype(text: object) -> np.dtype | None:
    """The dtype a manifest names, if it is a plain number type (no objects, records or sub-arrays)."""
    if not isinstance(text, str):
        return None
    try:
        dtype = np.dtype(text)
    except (TypeError, ValueError, SyntaxError):
        return None
    # native byte order only: the writer stores arrays as they are in memory, and a swapped dtype would
    # pass every check here and then fail to match the model's parameters far from the file
    native = dtype.byteorder in ("=", "|") or dtype == dtype.newbyteorder("=")
    return dtype if dtype.kind in "biufc" and dtype.shape == () and dtype.names is None and native else None


def _map_member(path: Path, f: BinaryIO, info: zipfile.ZipInfo, entry: dict, error: type[OdtError]) -> np.ndarray:
    """Memory-map one stored .npy member of the file open as ``f``: its bytes sit uncompressed
    inside the zip. Its header must agree with the manifest, its shape be one numpy can hold, and
    header plus data must fill the member exactly, before anything is allocated or mapped (a
    header may declare 2**40 elements, or none along one axis and 2**63 along another)."""
    name = entry.get("name")
    f.seek(info.header_offset)
    local = f.read(_LOCAL_HEADER)
    if local[:4] != b"PK\x03\x04":
        raise error(f"{path}: tensor {name!r}: bad zip local header")
    name_len, extra_len = struct.unpack("<HH", local[26:30])
    start = info.header_offset + _LOCAL_HEADER + name_len + extra_len
    f.seek(start)
    try:
        version = np.lib.format.read_magic(f)
        if version not in ((1, 0), (2, 0)):
            raise ValueError(f"npy format version {version} (ODT writes 1.0 or 2.0)")
        # numpy would read the header's declared length in one go (2.0 allows 4 GiB) before it
        # checks it: bound it by the member first
        width = 2 if version == (1, 0) else 4
        declared = int.from_bytes(f.read(width), "little")
        if declared > min(info.file_size, MAX_NPY_HEADER):
            raise ValueError(f"the header declares {declared} bytes, past its member or the {MAX_NPY_HEADER}-byte limit")
        # a numeric array's header is one flat dict with a shape tuple; deep nesting would only
        # make numpy's tokenizer and literal_eval spend seconds before refusing it
        header = f.read(declared)
        if sum(header.count(c) for c in b"([{") > 2:
            raise ValueError("the header nests brackets; a numeric array's header is {'descr', 'fortran_order', 'shape'}")
        f.seek(-(width + declared), os.SEEK_CUR)
        read_header = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
        shape, fortran, dtype = read_header(f)
    except Exception as exc:
        # SyntaxError, tokenize.TokenError, RecursionError, MemoryError... all mean a damaged header
        raise error(f"{path}: tensor {name!r}: bad array header: {type(exc).__name__}: {str(exc)[:200]}") from None
    offset = f.tell()
    if dtype.hasobject:
        raise error(f"{path}: tensor {name!r} holds Python objects; refusing to load it (no pickle)")
    shape = checked_shape(shape, dtype, error, f"{path}: tensor {name!r}")
    if list(shape) != list(entry.get("shape", [])) or dtype != np.dtype(entry.get("dtype")):
        raise error(f"{path}: tensor {name!r}: stored {dtype}{list(shape)} disagrees with the manifest")
    nbytes = math.prod(shape) * dtype.itemsize
    if offset - start + nbytes != info.file_size:
        raise error(f"{path}: tensor {name!r}: {dtype}{list(shape)} takes {nbytes} bytes, its member holds "
                    f"{info.file_size - (offset - start)}; the file is damaged")
    if nbytes == 0:
        return np.zeros(shape, dtype)
    try:
        mapped = np.memmap(f, dtype=dtype, mode="r", offset=offset, shape=shape or (1,), order="F" if fortran else "C")
    except (ValueError, OSError) as exc:  # the file shrank since its size was checked
        raise error(f"{path}: tensor {name!r}: cannot map its bytes: {type(exc).__name__}: {str(exc)[:200]}") from None
    return mapped if shape else mapped.reshape(())  # numpy maps no 0-d files
