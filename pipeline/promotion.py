"""The model in service and the job lock around changing it (python -m pipeline.retrain).

- ``job_lock``: one retraining job at a time (fcntl.flock, released by the kernel when the
  process dies); a second job waits, then gives up with ``Busy`` naming the holder.
- ``promote``: a new version is written in full under ``<state_dir>/models/<job id>/``
  (``io.publish_dir``, durable), then ``retrain.promoted_dir`` (a symbolic link) is
  pointed at it by one rename, so readers see the old version or the new one, never a
  mix. The last ``KEEP_VERSIONS`` versions stay for rollback.
"""
from __future__ import annotations

import contextlib
import datetime as dt
import errno
import fcntl
import json
import os
import shutil
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

from pipeline.errors import PipelineError
from pipeline.io import publish_dir, write_json

KEEP_VERSIONS = 3
INFO = "metrics.json"  # a version's record: the job that made it and the candidate's evaluation


class Busy(Exception):
    """Another retrain job holds the lock."""


@contextlib.contextmanager
def job_lock(path: Path, wait: float = 0.0) -> Iterator[None]:
    """Exclusive fcntl lock on ``path`` for the job's lifetime (released by the kernel if
    the process dies); raises Busy naming the holder after ``wait`` seconds."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        deadline = time.monotonic() + wait
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as exc:
                if exc.errno not in (errno.EAGAIN, errno.EACCES):
                    raise
                if time.monotonic() >= deadline:
                    text = os.pread(fd, 4096, 0).decode(errors="replace").strip()
                    holder = text.splitlines()[0] if text else "holder unknown"
                    raise Busy(f"another retrain job holds {path} ({holder})") from None
                time.sleep(min(1.0, max(0.05, deadline - time.monotonic())))
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()}, started {now()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)  # closing releases the lock


def promoted_info(promoted: Path) -> dict | None:
    """The promoted version's record, or None when nothing was promoted yet."""
    path = promoted / INFO
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise PipelineError(f"{path}: unreadable ({exc}); move {promoted} aside to start over") from None


def promote(files: Mapping[str, Path], info: dict, promoted: Path, versions: Path) -> Path:
    """Write ``files`` and ``info`` as version ``info["job"]["id"]``, then point ``promoted``
    (a symlink) at it in one rename; returns the version's folder."""
    version = versions / info["job"]["id"]
    with publish_dir(version, durable=True) as staging:
        for name, src in files.items():
            shutil.copyfile(src, staging / name)
        write_json(staging / INFO, info)
    if promoted.exists() and not promoted.is_symlink():  # a plain folder from elsewhere: keep it as a version
        os.replace(promoted, versions / f"legacy-{stamp()}")
    link = promoted.parent / f".{promoted.name}.link-{os.getpid()}"
    with contextlib.suppress(FileNotFoundError):
        link.unlink()
    os.symlink(os.path.relpath(version, promoted.parent), link)
    os.replace(link, promoted)  # atomic: readers see the old version or the new one
    _prune(versions, keep=version.name)
    return version


def _prune(versions: Path, keep: str) -> None:
    done = sorted((p for p in versions.iterdir() if p.is_dir() and not p.name.startswith(".")), key=lambda p: p.name)
    for old in done[:-KEEP_VERSIONS]:
        if old.name != keep:
            shutil.rmtree(old, ignore_errors=True)


def now() -> str:
    return dt.datetime.now().astimezone().isoformat(timespec="seconds")


def stamp() -> str:
    return dt.datetime.now().strftime("%Y%m%d-%H%M%S")
