"""Open a file named by an untrusted file, only if it is a regular file inside a given folder.

Models keep tensor data in files named by a ``location`` field, ONNX Runtime checkpoints in a
``.data`` file beside them. Whoever wrote the file chose those names, so a name is followed
only when, with every symlink resolved, it stays inside the folder (a ``..``, an absolute
path, a symlink placed in the folder or a symlinked sub-folder leading out are refused), and
the file opened is a regular file (not a directory, device, FIFO or socket; checked on the
opened descriptor, so nothing can be swapped in between).
"""
from __future__ import annotations

import os
import stat
from typing import BinaryIO

from odt_ops.errors import OdtError


def resolve_inside(folder: str | os.PathLike, location: str, error: type[OdtError], what: str) -> str:
    """The real path of ``location`` (relative to ``folder``), or ``error`` when it is unsafe or leads out."""
    if not location or os.path.isabs(location) or "\0" in location or "\\" in location or ".." in location.split("/"):
        raise error(f"{what}: unsafe location {location!r}; it must name a file inside {os.fspath(folder)}")
    root = os.path.realpath(folder)
    real = os.path.realpath(os.path.join(root, location))
    if os.path.commonpath([root, real]) != root or real == root:
        raise error(f"{what}: location {location!r} leads outside the folder {root} (through a symlink); refusing to read it")
    return real


def open_regular(path: str | os.PathLike, error: type[OdtError], what: str) -> BinaryIO:
    """``path`` opened for reading, without following a symlink at its end and without blocking
    on a FIFO; ``error`` (saying what the file is) unless it is a regular file."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    except FileNotFoundError:
        raise error(f"{what}: {os.fspath(path)!r} is missing; keep it next to the file that names it") from None
    except OSError as exc:
        raise error(f"{what}: cannot open {os.fspath(path)!r}: {exc.strerror or exc}") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise error(f"{what}: {os.fspath(path)!r} is {file_kind(mode)}, not a regular file; refusing to read it")
    return os.fdopen(fd, "rb")


def file_kind(mode: int) -> str:
    """What a non-regular file is, for a message: 'a folder', 'a FIFO (named pipe)', ..."""
    kinds = ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
             (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))
    return next((text for test, text in kinds if test(mode)), "a special file")
