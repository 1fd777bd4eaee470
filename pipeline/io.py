"""Atomic outputs: a reader (or a crash) never sees half a file or half a stage.

Single files go through ``odt_ops.io.atomic_writer`` (temp file, fsync, rename).
A stage's whole output directory is built in a staging directory beside it and
swapped in only when the stage succeeded (``publish_dir``), so a failing stage leaves
the previous outputs as they were.
"""
from __future__ import annotations

import contextlib
import glob
import hashlib
import io
import json
import math
import os
import shutil
import tempfile
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from odt_ops.io import atomic_write_bytes, atomic_writer, process_alive
from pipeline.errors import DataError


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def write_json(path: str | os.PathLike, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")


def flatten(tree: dict, prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}`` (metrics files to MLflow keys); lists stay values."""
    out: dict[str, Any] = {}
    for k, v in tree.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        if isinstance(v, dict) and v:
            out.update(flatten(v, key))
        else:
            out[key] = v
    return out


def nest(flat: dict[str, Any]) -> dict:
    """``{"a.b": 1}`` -> ``{"a": {"b": 1}}``, the inverse of ``flatten``."""
    out: dict = {}
    for key, value in flat.items():
        node = out
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return out


def save_npz(path: str | os.PathLike, **arrays: np.ndarray) -> None:
    """Uncompressed .npz, written atomically; loadable with allow_pickle=False."""
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    atomic_write_bytes(path, buf.getvalue())


def load_npz(path: str | os.PathLike, keys: tuple[str, ...] = ("x", "y"), *, what: str = "data file") -> dict[str, np.ndarray]:
    """Arrays ``keys`` of an .npz; a missing, unreadable or incomplete file is a DataError
    naming the file (never a pickle load)."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: {what} not found" + ("; run the stage that writes it (dvc repro)" if "data/" in str(path) else ""))
    try:
        _check_declared_sizes(path, keys, what)
        with np.load(path, allow_pickle=False) as npz:
            missing = [k for k in keys if k not in npz.files]
            if missing:
                raise DataError(f"{path}: {what} has no array(s) {missing} (found {sorted(npz.files)}); save it with np.savez(path, {', '.join(f'{k}=...' for k in keys)})")
            return {k: npz[k] for k in keys}
    except DataError:
        raise
    except (OSError, ValueError, zipfile.BadZipFile, EOFError, MemoryError) as exc:
        raise DataError(f"{path}: not a readable .npz {what} ({str(exc).splitlines()[0] if str(exc) else type(exc).__name__}); rewrite it with np.savez") from None


MAX_NPY_HEADER = 10_000  # numpy's own limit for headers it parses without allow_pickle (np.load's max_header_size)


def _check_declared_sizes(path: Path, keys: tuple[str, ...], what: str) -> None:
    """Each array's header against the bytes its member holds, before numpy allocates what
    the header declares (a forged header asking for 10**12 floats is a DataError, not a
    4 TB allocation)."""
    with zipfile.ZipFile(path) as zf:
        names = set(zf.namelist())
        for key in keys:
            if f"{key}.npy" not in names:
                continue  # np.load reports the missing array
            info = zf.getinfo(f"{key}.npy")
            with zf.open(info) as member:
                version = np.lib.format.read_magic(member)
                # numpy reads the whole header its length field declares before its own size limit
                # applies: a deflated member can declare gigabytes of header in a few kilobytes
                length = int.from_bytes(member.read(2 if version == (1, 0) else 4), "little")
                if length > MAX_NPY_HEADER:
                    raise DataError(f"{path}: {what} array {key!r} declares a {length:,}-byte header (an .npy header is at most "
                                    f"{MAX_NPY_HEADER:,}); the file is damaged or forged, rewrite it with np.savez")
            with zf.open(info) as member:
                version = np.lib.format.read_magic(member)
                read_header = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
                shape, _, dtype = read_header(member)
                declared = math.prod(shape) * dtype.itemsize
                held = info.file_size - member.tell()
            if declared > held:
                raise DataError(f"{path}: {what} array {key!r} declares shape {list(shape)} {dtype} ({declared:,} bytes) but holds "
                                f"{held:,} bytes; the file is truncated or damaged, rewrite it with np.savez")


def sha256_file(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


KEEP = (".gitignore",)  # DVC's entries for a stage's cached files; they survive a rerun
DIGESTS = "SHA256SUMS"  # a stage's record of what it wrote, in sha256sum's format (sha256sum -c SHA256SUMS)


@contextlib.contextmanager
def publish_dir(target: str | os.PathLike, *, durable: bool = False) -> Iterator[Path]:
    """Yield an empty staging directory beside ``target``; on success it replaces
    ``target``, on error it is deleted and ``target`` keeps its previous content. The old
    directory's ``.gitignore`` (written by DVC) is carried over. ``durable``: every file
    is fsynced before the swap (for state that must survive a power cut, not for
    outputs a rerun rebuilds).

    The swap is three renames (staging -> ``.<name>.ready-<pid>``, target ->
    ``.<name>.old-<pid>``, ready -> target); a process killed between them leaves the
    ready copy, which the next ``publish_dir`` (or ``recover``) of the same target
    moves into place."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    recover(target)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.staging-", dir=target.parent))
    os.chmod(staging, 0o777 & ~_umask())  # mkdtemp makes it private; outputs are ordinary folders
    try:
        yield staging
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    for name in KEEP:
        if (target / name).is_file() and not (staging / name).exists():
            shutil.copy2(target / name, staging / name)
    if durable:
        _fsync_tree(staging)
    _swap(staging, target)
    if durable:
        _fsync_dir(target.parent)


def _swap(staging: Path, target: Path) -> None:
    ready = _leftover(target, "ready", os.getpid())
    os.replace(staging, ready)  # complete from here on: a crash is finished by recover()
    old = None
    if target.exists():
        old = _leftover(target, "old", os.getpid())
        shutil.rmtree(old, ignore_errors=True)
        os.replace(target, old)
    os.replace(ready, target)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def recover(target: str | os.PathLike) -> str | None:
    """Finish or undo a ``publish_dir`` swap that a killed process left half done: with no
    ``target``, the newest complete (ready) copy moves into place, else the newest old one
    moves back; then the leftovers of dead processes go. Returns what it did, or None."""
    target = Path(target)
    done = None
    ready, old = _leftovers(target, "ready"), _leftovers(target, "old")
    if not target.exists() and (ready or old):
        src = (ready or old)[-1]
        os.replace(src, target)
        done = f"{target}: finished a swap a killed run left half done (from {src.name})" if ready else \
            f"{target}: restored the previous outputs a killed run left aside ({src.name})"
    for leftover in _leftovers(target, "ready") + _leftovers(target, "old"):
        shutil.rmtree(leftover, ignore_errors=True)
    return done


def _leftover(target: Path, kind: str, pid: int) -> Path:
    return target.parent / f".{target.name}.{kind}-{pid}"


def _leftovers(target: Path, kind: str) -> list[Path]:
    """``.<name>.<kind>-<pid>`` beside ``target`` of processes no longer running, oldest first."""
    found = []
    for p in target.parent.glob(f".{glob.escape(target.name)}.{kind}-*"):
        pid = p.name.rsplit("-", 1)[-1]
        if pid.isdigit() and (int(pid) == os.getpid() or not process_alive(int(pid))):
            found.append(p)
    return sorted(found, key=lambda p: p.stat().st_mtime_ns)


def _fsync_tree(directory: Path) -> None:
    for path in sorted(directory.rglob("*")):
        if path.is_file():
            with open(path, "rb") as f:
                os.fsync(f.fileno())
    for d in [directory, *(p for p in directory.rglob("*") if p.is_dir())]:
        _fsync_dir(d)


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_digests(directory: str | os.PathLike) -> Path:
    """Record the sha256 of every file under ``directory`` (dotfiles aside) in
    ``directory/SHA256SUMS``; a stage calls it last, so later readers can tell a file
    that changed after it was written (``verify_digest``)."""
    directory = Path(directory)
    files = [p for p in directory.rglob("*") if p.is_file() and p.name != DIGESTS
             and not any(part.startswith(".") for part in p.relative_to(directory).parts)]
    atomic_write_text(directory / DIGESTS, sums_text(directory, files))
    return directory / DIGESTS


def sums_text(directory: Path, files) -> str:
    """``sha256sum``'s output for ``files`` (under ``directory``), sorted by relative path."""
    rels = sorted((p.relative_to(directory).as_posix(), p) for p in files)
    return "".join(f"{sha256_file(p)}  {rel}\n" for rel, p in rels)


def verify_digest(path: str | os.PathLike, shown: str | None = None) -> None:
    """``path`` still has the sha256 its stage recorded in the SHA256SUMS of its folder
    (no record: nothing to check); a difference is a DataError naming the file."""
    path = Path(path)
    sums = path.parent / DIGESTS
    if not sums.is_file():
        return
    recorded = {}
    for line in sums.read_text(encoding="utf-8").splitlines():
        digest, _, name = line.partition("  ")
        recorded[name] = digest
    want = recorded.get(path.name)
    if want is None or not path.is_file():
        return
    got = sha256_file(path)
    if got != want:
        raise DataError(f"{shown or path}: changed after its stage wrote it (sha256 {got[:12]}..., recorded {want[:12]}... in "
                        f"{sums.name}); restore it with dvc checkout --force {shown or path} (git checkout -- for a file kept in git), "
                        "or rerun the stage that writes it (dvc repro -f <stage>)")


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


__all__ = ["atomic_write_bytes", "atomic_write_text", "atomic_writer", "flatten", "load_npz", "nest", "publish_dir", "recover", "save_npz",
           "sha256_file", "verify_digest", "write_digests", "write_json"]
