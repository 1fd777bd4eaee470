"""One process per DVC command writes every stage's tracking records to MLflow.

A stage under DVC imports no mlflow: its tracker (pipeline.tracking.RecordingRun) spools
its run to ``<tracking root>/.mlflow-spool/`` and this logging process writes it
(pipeline.mlflow_writer), so ``import mlflow`` and opening the store (2 to 3 s of CPU, and on
a fresh clone the SQLite schema's creation) happen once per DVC command, on the other core,
while the stages work. The spool:

- ``dvc-<pid>-<start>.alive``: a DVC command whose stages track (its process id and start
  time); its store and experiment inside, so the logger opens them before the first run
  arrives. The logger stays while any of these processes runs.
- ``<time>-<id>.files/``: hard links to (or copies of) every file a run logs, taken when the
  stage logs it, so later commands or a removed temporary copy cannot change them.
- ``<time>-<id>.jsonl``: a finished run's records, written atomically when its stage ends.
- ``logger.lock``: held by the one logging process (``flock``); ``failed/``: runs MLflow
  refused, each with its reason (``--wait`` lists them). A run's files with no records a day
  later (its stage was killed outright) are removed when a logger starts.

Every stage starts a logger if none holds the lock (when it starts and when it ends). The
logger writes runs in the order they started and exits when no run is pending and no DVC
command it serves is running. ``dvc repro`` can therefore return a moment before its last
stage's run is in MLflow; ``python -m pipeline.mlflow_logger --wait`` returns when every
spooled run is written (it writes what is left itself when no logger runs) and exits 1
naming any run that could not be.
"""
from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

from pipeline.errors import TrackingError
from pipeline.paths import tracking_root

SPOOL = ".mlflow-spool"
POLL = 0.1  # seconds between the logger's looks at the spool
IDLE_LIMIT = 3600.0  # a logger whose DVC commands never end (a stale marker) gives up after this
STALE = 86400.0  # a run's files with no records after a day: its stage was killed (SIGKILL) before it ended


def spool_dir() -> Path:
    return tracking_root() / SPOOL


# --------------------------------------------------------------------------- the stage's side


class SpoolSink:
    """Spools one run (pipeline.tracking.RecordingRun's sink) for the logging process."""

    def __init__(self, dvc_key: str | None, directory: Path | None = None):
        """``dvc_key``: the DVC command running the stage (pipeline.tracking.dvc_invocation_key)."""
        import importlib.util

        if importlib.util.find_spec("mlflow") is None:
            raise TrackingError("tracking needs mlflow: pip install -e '.[pipeline]', or run with tracking=disabled")
        self.dir = directory or spool_dir()
        self.name = f"{time.time_ns()}-{uuid.uuid4().hex[:12]}"
        self.files = self.dir / f"{self.name}.files"
        self._kept = 0
        self.dvc_key = dvc_key

    def open(self, start: dict) -> tuple[str, str | None]:
        self.files.mkdir(parents=True, exist_ok=True)
        key = self.dvc_key
        if key is not None:  # the logger serves this DVC command until it ends, and opens its store now
            marker = self.dir / f"{_dvc_process(key)}.alive"
            if not marker.exists():
                _atomic_write(marker, json.dumps({"uri": start["uri"], "experiment": start["experiment"]}))
        ensure_logger(self.dir)
        parent = start.get("parent") or {}
        return f"spool-{self.name}", parent.get("id")

    def keep(self, path: str | os.PathLike) -> str:
        """A hard link to ``path`` (a file or a folder of them) in this run's spool folder."""
        path = Path(path)
        self._kept += 1
        dest = self.files / f"{self._kept:03d}" / path.name
        dest.parent.mkdir(parents=True, exist_ok=True)
        if path.is_dir():
            shutil.copytree(path, dest, copy_function=_link)
        else:
            _link(path, dest)
        return str(dest)

    def add(self, run, rec: dict) -> None:
        run.records.append(rec)

    def model(self, run, rec: dict, input_example) -> None:
        import numpy as np

        example = self.files / f"example-{self._kept:03d}.npy"
        np.save(example, np.asarray(input_example), allow_pickle=False)
        self.add(run, {**rec, "example": str(example)})
        return None  # its runs:/ URI exists once the logger has written it

    def register(self, run, model_uri: str, name: str, alias: str) -> None:
        raise TrackingError("registering a model needs its run written at once: run with ODT_TRACKING_MODE=direct")

    def close(self, run, end: dict) -> None:
        from pipeline.mlflow_writer import dumps

        _atomic_write(self.dir / f"{self.name}.jsonl", dumps([run.start, *run.records, end]))
        ensure_logger(self.dir)


def _link(src, dst) -> None:
    try:
        os.link(src, dst)
    except OSError:  # another file system, or links not allowed: a copy
        shutil.copy2(src, dst)


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def _dvc_process(key: str) -> str:
    """``dvc-<pid>-<start>`` of an invocation key (pipeline.tracking.dvc_invocation_key)."""
    return "-".join(key.split("-")[:3])


def ensure_logger(directory: Path) -> None:
    """Start a logging process unless one holds the lock."""
    if _lock(directory, block=False, probe=True) is None:
        return
    import pipeline

    env = dict(os.environ)
    package_parent = str(Path(pipeline.__file__).resolve().parent.parent)  # the stage's own code, also in a temporary copy
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_parent, env.get("PYTHONPATH")]))
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / "logger.log", "ab") as log:
        subprocess.Popen([sys.executable, "-m", "pipeline.mlflow_logger", "--serve", str(directory)], cwd=directory,
                         env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True, close_fds=True)


# --------------------------------------------------------------------------- the logger's side


def _lock(directory: Path, *, block: bool, probe: bool = False, timeout: float | None = None) -> int | None:
    """The logger lock's file descriptor, held; None when another process holds it. ``probe``:
    released at once (the answer is only whether it was free)."""
    directory.mkdir(parents=True, exist_ok=True)
    fd = os.open(directory / "logger.lock", os.O_CREAT | os.O_RDWR, 0o644)
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            if not block or (deadline is not None and time.monotonic() > deadline):
                os.close(fd)
                return None
            time.sleep(POLL)
    if probe:
        os.close(fd)
    return fd


def _unlock(fd: int) -> None:
    os.close(fd)  # closing the descriptor releases the flock


def pending(directory: Path) -> list[Path]:
    """Finished runs not yet written, oldest first."""
    return sorted(directory.glob("*.jsonl")) if directory.is_dir() else []


def live_commands(directory: Path) -> list[dict]:
    """The stores of the DVC commands still running; markers of ended ones are removed."""
    live = []
    for marker in sorted(directory.glob("dvc-*.alive")) if directory.is_dir() else []:
        _, pid, start = marker.stem.split("-")[:3]
        if _running(int(pid), start):
            with contextlib.suppress(OSError, ValueError):
                live.append(json.loads(marker.read_text(encoding="utf-8")))
        else:
            marker.unlink(missing_ok=True)
    return live


def _running(pid: int, start: str) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[19] == start  # the same process, not a reused pid


def write_pending(directory: Path, writer) -> int:
    """Write every pending run; a run MLflow refuses moves to ``failed/`` with its reason."""
    from pipeline.mlflow_writer import loads

    done = 0
    for path in pending(directory):
        files = directory / f"{path.stem}.files"
        try:
            writer.write_run(loads(path.read_text(encoding="utf-8")), spool_id=path.stem)
            path.unlink()
        except Exception as exc:  # one bad run must not stop the others
            failed = directory / "failed"
            failed.mkdir(exist_ok=True)
            os.replace(path, failed / path.name)
            reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            _atomic_write(failed / f"{path.stem}.reason", f"{type(exc).__name__}: {reason}\n")
        shutil.rmtree(files, ignore_errors=True)
        done += 1
    return done


def serve(directory: Path) -> int:
    """The logging process: write runs as they come while a DVC command it serves runs; at
    its end one line in logger.log: runs written, CPU and wall time (scripts/pipeline_timing.py)."""
    fd = _lock(directory, block=False)
    if fd is None:
        return 0  # another logger serves the spool
    t0 = time.perf_counter()
    written = 0
    try:
        written = _serve(directory, fd)
    finally:
        with open(directory / "logger.log", "a", encoding="utf-8") as log:
            print(f"logger {os.getpid()}: {written} run(s) written, {time.process_time():.2f} s CPU, "
                  f"{time.perf_counter() - t0:.2f} s wall", file=log)
    return 0


def remove_stale(directory: Path, now: float | None = None) -> list[Path]:
    """The kept files of runs whose stage died before writing its records (they never will)."""
    now = time.time() if now is None else now
    stale = [f for f in directory.glob("*.files")
             if not (directory / f"{f.stem}.jsonl").exists() and now - f.stat().st_mtime > STALE]
    for files in stale:
        shutil.rmtree(files, ignore_errors=True)
    return stale


def _serve(directory: Path, fd: int) -> int:
    from pipeline.mlflow_writer import Writer

    remove_stale(directory)
    writer = Writer()
    for store in live_commands(directory):  # open the store (on a fresh clone: create it) while the stages work
        with contextlib.suppress(Exception):
            writer.client(store["uri"])
            writer.experiment(store["uri"], store["experiment"])
    idle_since = time.monotonic()
    written = 0
    while True:
        done = write_pending(directory, writer)
        if done:
            written += done
            idle_since = time.monotonic()
            continue
        if live_commands(directory) and time.monotonic() - idle_since < IDLE_LIMIT:
            time.sleep(POLL)
            continue
        _unlock(fd)  # nothing left: leave, unless a run or a command arrived meanwhile and no new logger took over
        if not (pending(directory) or live_commands(directory)):
            return written
        fd = _lock(directory, block=False)
        if fd is None:
            return written


def wait(directory: Path | None = None, timeout: float | None = None) -> list[str]:
    """Return when every spooled run is in MLflow (waiting for a running logger, then writing
    what is left here); the runs that could not be written, one line each."""
    directory = directory or spool_dir()
    if not directory.is_dir():
        return []
    fd = _lock(directory, block=True, timeout=timeout)
    if fd is None:
        raise TrackingError(f"{directory}: a logging process still holds logger.lock after {timeout:g} s")
    try:
        if pending(directory):
            from pipeline.mlflow_writer import Writer

            write_pending(directory, Writer())
    finally:
        _unlock(fd)
    return failures(directory)


def failures(directory: Path) -> list[str]:
    failed = directory / "failed"
    return [f"{directory.name}/failed/{p.name}: {(failed / (p.stem + '.reason')).read_text(encoding='utf-8').strip()}"
            for p in sorted(failed.glob("*.jsonl"))] if failed.is_dir() else []


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pipeline.mlflow_logger", description=__doc__.split("\n\n")[0])
    ap.add_argument("--wait", action="store_true", help="return when every spooled run is in MLflow (exit 1 naming any that is not)")
    ap.add_argument("--timeout", type=float, default=None, help="--wait: give up after this many seconds")
    ap.add_argument("--serve", type=Path, metavar="SPOOL", help=argparse.SUPPRESS)  # what a stage starts
    args = ap.parse_args(argv)
    if args.serve:
        return serve(args.serve)
    try:
        failed = wait(timeout=args.timeout)
    except TrackingError as exc:
        print(f"tracking: error: {exc}", file=sys.stderr)
        return 1
    for line in failed:
        print(f"tracking: not written to MLflow: {line}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
