"""Which files the process opens, through a CPython audit hook.

Every ``open`` (builtins.open, io.open, os.open, pathlib) and ``mmap.__new__`` raises an audit
event before the file is touched (PEP 578), so the hook sees reads that numpy, onnx's Python
code or ours make. Audit hooks cannot be removed once added, so one hook is installed for the
process and records only while a ``watching`` block is active.
"""
from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator

_active: list[list[str]] = []


def _hook(event: str, args: tuple) -> None:
    if not _active or event != "open":
        return
    path = args[0]
    if isinstance(path, int):  # os.open on a descriptor: the file was opened (and seen) before
        return
    try:
        name = os.fsdecode(path)
    except (TypeError, ValueError):
        return
    for opened in _active:
        opened.append(os.path.abspath(name))


_installed = False


def _install() -> None:
    global _installed
    if not _installed:
        sys.addaudithook(_hook)
        _installed = True


@contextlib.contextmanager
def watching() -> Iterator[list[str]]:
    """Within, every path the process opens is appended (absolute, as given) to the yielded list."""
    _install()
    opened: list[str] = []
    _active.append(opened)
    try:
        yield opened
    finally:
        _active.remove(opened)


def _code_roots() -> tuple[str, ...]:
    """Where the interpreter legitimately reads while a case runs: its own and the packages'
    files (lazy imports), and numpy's and onnx's data."""
    roots = {sys.prefix, sys.base_prefix, sys.exec_prefix, os.path.dirname(os.path.dirname(os.path.dirname(__file__)))}
    roots |= {p for p in sys.path if p and os.path.isdir(p)}
    return tuple(os.path.realpath(r) for r in roots)


def outside(opened: list[str], folder: str | os.PathLike) -> list[str]:
    """The opened paths that resolve outside ``folder`` and outside the interpreter's code."""
    inside = os.path.realpath(folder)
    allowed = (inside, *_code_roots())
    bad = []
    for path in opened:
        real = os.path.realpath(path)
        if not any(os.path.commonpath([real, root]) == root for root in allowed):
            bad.append(path if real == path else f"{path} -> {real}")
    return bad
