"""Zip files assembled by hand, so a test can write what zipfile itself never would: members whose
declared sizes lie, deflate bombs built without deflating gigabytes, odd methods.

Layout (APPNOTE.TXT 4.3): for each member a local file header (signature PK\\3\\4, 30 bytes +
name) and its data; then one central directory header per member (PK\\1\\2, 46 bytes + name);
then the end of central directory record (PK\\5\\6, 22 bytes). No zip64: tests stay under 4 GiB
of declared size per member.
"""
from __future__ import annotations

import io
import struct
import zlib
from dataclasses import dataclass

STORED, DEFLATED = 0, 8


@dataclass
class Member:
    name: str
    data: bytes  # as stored in the file (compressed when method is DEFLATED)
    method: int = STORED
    crc: int | None = None  # None: the CRC of data (right for a stored member)
    file_size: int | None = None  # declared uncompressed size; None: len(data)


def read_members(data: bytes) -> list[Member]:
    """The members of a zip as stored members (their uncompressed bytes)."""
    import zipfile

    with zipfile.ZipFile(io.BytesIO(data)) as zf:
        return [Member(info.filename, zf.read(info)) for info in zf.infolist()]


def build(members: list[Member]) -> bytes:
    out = io.BytesIO()
    central = []
    for m in members:
        name = m.name.encode()
        crc = zlib.crc32(m.data) if m.crc is None else m.crc
        size = len(m.data) if m.file_size is None else m.file_size
        offset = out.tell()
        out.write(struct.pack("<4sHHHHHIIIHH", b"PK\x03\x04", 20, 0, m.method, 0, 0x21, crc, len(m.data), size, len(name), 0))
        out.write(name)
        out.write(m.data)
        central.append(struct.pack("<4sHHHHHHIIIHHHHHII", b"PK\x01\x02", 20, 20, 0, m.method, 0, 0x21, crc, len(m.data), size,
                                   len(name), 0, 0, 0, 0, 0, offset) + name)
    start = out.tell()
    for c in central:
        out.write(c)
    out.write(struct.pack("<4sHHHHIIH", b"PK\x05\x06", 0, 0, len(central), len(central), out.tell() - start, start, 0))
    return out.getvalue()


def deflate_bomb(inflated: int, prefix: bytes = b"") -> bytes:
    """A raw deflate stream that inflates to ``prefix`` + spaces, ``inflated`` bytes in all, built by
    repeating one fully flushed 1 MiB segment (each segment stands alone after a full flush)."""
    chunk = 1 << 20
    head = zlib.compressobj(9, zlib.DEFLATED, -15)
    first = head.compress(prefix) + head.flush(zlib.Z_FULL_FLUSH)
    seg = zlib.compressobj(9, zlib.DEFLATED, -15)
    segment = seg.compress(b" " * chunk) + seg.flush(zlib.Z_FULL_FLUSH)
    n, rest = divmod(inflated - len(prefix), chunk)
    tail = zlib.compressobj(9, zlib.DEFLATED, -15)
    last = tail.compress(b" " * rest) + tail.flush(zlib.Z_FINISH)
    return first + segment * n + last
