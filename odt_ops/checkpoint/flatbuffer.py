"""A bounds-checked reader for FlatBuffer tables, enough for ONNX Runtime's checkpoint.

ONNX Runtime writes its training checkpoint as a FlatBuffer. Reading one takes a
handful of rules (root offset, vtables, relative offsets, length-prefixed vectors and
strings), so the engine reads it with this module instead of depending on the
flatbuffers package. Every read checks its bounds first and raises ``Malformed``
with a description of what is wrong, never struct.error or IndexError: the input is a
file from a device, possibly truncated or damaged.
"""
from __future__ import annotations

import struct

import numpy as np

_U8, _U16, _I32, _U32, _I64, _F32 = (struct.Struct(f"<{c}") for c in "BHiIqf")


class Malformed(Exception):
    """The buffer breaks a FlatBuffer rule; the message says which and where."""


class Buffer:
    """The bytes of one FlatBuffer, read with checked offsets."""

    def __init__(self, data: bytes):
        self.data = bytes(data)
        self.size = len(self.data)

    def unpack(self, fmt: struct.Struct, pos: int, what: str):
        if pos < 0 or pos + fmt.size > self.size:
            raise Malformed(f"{what} at byte {pos} lies outside the {self.size}-byte buffer")
        return fmt.unpack_from(self.data, pos)[0]

    def identifier(self) -> bytes:
        if self.size < 8:
            raise Malformed(f"{self.size} bytes is too short for a FlatBuffer header (8 bytes)")
        if self.size % 4:  # a builder pads the whole buffer to its alignment, 4 bytes at least
            raise Malformed(f"its size, {self.size} bytes, is not a multiple of 4: the file is truncated or extended")
        return bytes(self.data[4:8])

    def root(self) -> Table:
        return Table(self, self.target(0, "the root table offset"), "root table")

    def target(self, pos: int, what: str) -> int:
        """The position a uoffset stored at ``pos`` points to (offsets point forward)."""
        offset = self.unpack(_U32, pos, what)
        target = pos + offset
        if offset == 0 or target >= self.size:
            raise Malformed(f"{what} at byte {pos} points to byte {target}, outside the {self.size}-byte buffer")
        return target


class Table:
    """One table: fields are looked up by their index in the schema (0-based)."""

    def __init__(self, buf: Buffer, pos: int, what: str):
        self.buf, self.pos, self.what = buf, pos, what
        vtable = pos - buf.unpack(_I32, pos, f"{what}'s vtable offset")
        self.vt_size = buf.unpack(_U16, vtable, f"{what}'s vtable size")
        table_size = buf.unpack(_U16, vtable + 2, f"{what}'s table size")
        if self.vt_size < 4 or self.vt_size % 2 or vtable + self.vt_size > buf.size:
            raise Malformed(f"{what}: vtable at byte {vtable} has an invalid size {self.vt_size}")
        if table_size < 4 or pos + table_size > buf.size:
            raise Malformed(f"{what}: table at byte {pos} of size {table_size} runs past the {buf.size}-byte buffer")
        self.vtable, self.table_size = vtable, table_size

    def _field(self, index: int, width: int, name: str) -> int | None:
        """Position of field ``index`` (None when absent, so the default applies)."""
        slot = 4 + 2 * index
        if slot >= self.vt_size:
            return None
        off = self.buf.unpack(_U16, self.vtable + slot, f"{self.what}.{name}'s vtable entry")
        if off == 0:
            return None
        if off + width > self.table_size:
            raise Malformed(f"{self.what}.{name}: field offset {off} lies outside its {self.table_size}-byte table")
        return self.pos + off

    def _scalar(self, index: int, fmt: struct.Struct, name: str, default):
        pos = self._field(index, fmt.size, name)
        return default if pos is None else self.buf.unpack(fmt, pos, f"{self.what}.{name}")

    def bool(self, index: int, name: str, default: bool = False) -> bool:
        return bool(self._scalar(index, _U8, name, int(default)))

    def i32(self, index: int, name: str, default: int = 0) -> int:
        return self._scalar(index, _I32, name, default)

    def i64(self, index: int, name: str, default: int = 0) -> int:
        return self._scalar(index, _I64, name, default)

    def f32(self, index: int, name: str, default: float = 0.0) -> float:
        return self._scalar(index, _F32, name, default)

    def _ref(self, index: int, name: str) -> int | None:
        pos = self._field(index, 4, name)
        return None if pos is None else self.buf.target(pos, f"{self.what}.{name}")

    def table(self, index: int, name: str) -> Table | None:
        pos = self._ref(index, name)
        return None if pos is None else Table(self.buf, pos, f"{self.what}.{name}")

    def string(self, index: int, name: str) -> str | None:
        pos = self._ref(index, name)
        return None if pos is None else _string_at(self.buf, pos, f"{self.what}.{name}")

    def _vector(self, index: int, name: str, elem_size: int) -> tuple[int, int] | None:
        """(position of the first element, length) of a vector field."""
        pos = self._ref(index, name)
        if pos is None:
            return None
        n = self.buf.unpack(_U32, pos, f"{self.what}.{name}'s length")
        if pos + 4 + n * elem_size > self.buf.size:
            raise Malformed(f"{self.what}.{name}: {n} elements of {elem_size} bytes run past the {self.buf.size}-byte buffer")
        return pos + 4, n

    def tables(self, index: int, name: str) -> list[Table] | None:
        vec = self._vector(index, name, 4)
        if vec is None:
            return None
        start, n = vec
        return [Table(self.buf, self.buf.target(start + 4 * i, f"{self.what}.{name}[{i}]"), f"{self.what}.{name}[{i}]")
                for i in range(n)]

    def strings(self, index: int, name: str) -> list[str] | None:
        vec = self._vector(index, name, 4)
        if vec is None:
            return None
        start, n = vec
        return [_string_at(self.buf, self.buf.target(start + 4 * i, f"{self.what}.{name}[{i}]"), f"{self.what}.{name}[{i}]")
                for i in range(n)]

    def int64s(self, index: int, name: str) -> list[int] | None:
        vec = self._vector(index, name, 8)
        if vec is None:
            return None
        start, n = vec
        return [int(v) for v in np.frombuffer(self.buf.data, dtype="<i8", count=n, offset=start)]

    def bytes(self, index: int, name: str) -> memoryview | None:
        vec = self._vector(index, name, 1)
        if vec is None:
            return None
        start, n = vec
        return memoryview(self.buf.data)[start : start + n]


def _string_at(buf: Buffer, pos: int, what: str) -> str:
    n = buf.unpack(_U32, pos, f"{what}'s length")
    if pos + 4 + n >= buf.size:  # the terminating NUL included
        raise Malformed(f"{what}: a {n}-byte string at byte {pos} runs past the {buf.size}-byte buffer")
    if buf.data[pos + 4 + n] != 0:
        raise Malformed(f"{what}: the string at byte {pos} lacks its terminating NUL")
    try:
        return bytes(buf.data[pos + 4 : pos + 4 + n]).decode("utf-8")
    except UnicodeDecodeError:
        raise Malformed(f"{what}: the string at byte {pos} is not UTF-8") from None
