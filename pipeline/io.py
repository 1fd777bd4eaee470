"""Atomic outputs: a reader (or a crash) never sees half a file or half a stage.

Single files go through ``odt_ops.io.atomic_writer`` (temp file, fsync, rename).
A stage's whole output directory is built in a staging directory beside it and
swapped in only when the stage succeeded (``publish_dir``), so a failing stage leaves
the previous outputs as they were.
"""
from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import shutil
import tempfile
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from odt_ops.io import atomic_write_bytes, atomic_writer
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
        with np.load(path, allow_pickle=False) as npz:
            missing = [k for k in keys if k not in npz.files]
            if missing:
                raise DataError(f"{path}: {what} has no array(s) {missing} (found {sorted(npz.files)}); save it with np.savez(path, {', '.join(f'{k}=...' for k in keys)})")
            return {k: npz[k] for k in keys}
    except DataError:
        raise
    except (OSError, ValueError, zipfile.BadZipFile, EOFError) as exc:
        raise DataError(f"{path}: not a readable .npz {what} ({str(exc).splitlines()[0] if str(exc) else type(exc).__name__}); rewrite it with np.savez") from None


def sha256_file(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


KEEP = (".gitignore",)  # DVC's entries for a stage's cached files; they survive a rerun


@contextlib.contextmanager
def publish_dir(target: str | os.PathLike) -> Iterator[Path]:
    """Yield an empty staging directory beside ``target``; on success it replaces
    ``target`` (rename, so the swap is all or nothing per directory), on error it is
    deleted and ``target`` keeps its previous content. The old directory's
    ``.gitignore`` (written by DVC) is carried over."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
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
    old = None
    if target.exists():
        old = target.parent / f".{target.name}.old-{os.getpid()}"
        shutil.rmtree(old, ignore_errors=True)
        os.replace(target, old)
    os.replace(staging, target)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


__all__ = ["atomic_write_bytes", "atomic_write_text", "atomic_writer", "flatten", "load_npz", "nest", "publish_dir", "save_npz", "sha256_file", "write_json"]
