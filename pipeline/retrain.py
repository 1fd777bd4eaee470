"""Scheduled retraining: the job cron, a systemd timer or CI calls.

    python -m pipeline.retrain [--force] [--wait SECONDS] [OVERRIDE ...]

1. Takes the job lock (``<retrain.state_dir>/lock``, fcntl.flock): a second job
   while one runs waits up to ``--wait``/``retrain.wait_seconds`` seconds, then exits
   with code 75 (EX_TEMPFAIL: "try again later") and a message naming the holder.
2. Hashes every file in the inbox (``retrain.inbox``, data/user/; dotfiles and
   READMEs aside). If that hash is the promoted model's, or the last kept candidate's,
   there is nothing new: it says so and exits 0 (``--force`` retrains anyway).
3. Reproduces the pipeline as a DVC experiment (``dvc exp run -n retrain-<time>``,
   so ``dvc exp show`` lists every job with its metrics), continuing from the
   promoted checkpoint (``-S train.init_checkpoint=... -S train.init_sha256=...``:
   weights and optimizer state) rather than from the pretrained model; the job's
   overrides are passed on as ``-S``.
4. Compares the candidate with the model in service on the current holdout: the
   promoted ``inference.onnx`` (or, before any promotion, the pretrained base) is run
   on the same ``user_holdout`` the candidate was evaluated on. It promotes when the
   candidate's accuracy is at least the current one's plus ``retrain.min_delta`` (and,
   when ``retrain.max_forgetting`` is set, it forgot at most that much of the global
   test accuracy), and otherwise keeps the current model, saying why.
5. Promotion is atomic: the new version is written in full under
   ``<state_dir>/models/<id>/`` and ``retrain.promoted_dir`` (data/promoted) is a
   symbolic link swapped to it by one rename. An interrupted or failed job never
   touches it. The last few versions stay for rollback.
6. The whole job is one MLflow run (``retrain``) with the stage runs nested under it:
   the decision, the reason and both accuracies as metrics and tags, and params.yaml,
   dvc.lock and the metrics as artifacts. ``<state_dir>/history.jsonl`` logs every
   decision.

Exit codes: 0 promoted, kept or nothing new; 1 the pipeline or an input failed; 2 bad
configuration; 75 another job holds the lock; 130 interrupted.
"""
from __future__ import annotations

import contextlib
import datetime as dt
import errno
import fcntl
import hashlib
import importlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from pipeline.config.schema import MISSING, Section
from pipeline.errors import EXIT_INPUT, PipelineError

EXIT_BUSY = 75
KEEP_VERSIONS = 3


@dataclass
class RetrainConfig(Section):
    """The job's ``retrain`` section (no stage lists it as a DVC param: it never reruns a stage)."""

    inbox: str = MISSING
    promoted_dir: str = MISSING
    state_dir: str = MISSING
    continue_from_promoted: bool = MISSING
    min_delta: float = MISSING
    max_forgetting: Optional[float] = MISSING
    wait_seconds: float = MISSING

    def check(self) -> None:
        for key in ("inbox", "promoted_dir", "state_dir"):
            self.need(bool(getattr(self, key)), key, "a path relative to the repository")
        self.need(self.max_forgetting is None or self.max_forgetting >= 0, "max_forgetting",
                  "null or a number >= 0 (accuracy points as a fraction)")
        self.need(self.wait_seconds >= 0, "wait_seconds", "a number >= 0 (0: exit at once when a job is running)")


CONFIG = {"retrain": RetrainConfig}


class Busy(Exception):
    """Another retrain job holds the lock."""


class JobError(PipelineError):
    """The pipeline failed inside the job; the promoted model is unchanged."""


# --------------------------------------------------------------------------- pieces


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
        os.pwrite(fd, f"pid {os.getpid()}, started {_now()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)  # closing releases the lock


def inbox_digest(inbox: Path) -> tuple[str, int]:
    """SHA-256 over the inbox's files (relative names and contents), with their count."""
    h = hashlib.sha256()
    n = 0
    if inbox.is_file():
        files = [inbox]
        base = inbox.parent
    else:
        files = sorted(p for p in inbox.rglob("*") if p.is_file()) if inbox.is_dir() else []
        base = inbox
    for p in files:
        rel = p.relative_to(base)
        if any(part.startswith(".") for part in rel.parts) or p.name.upper().startswith("README"):
            continue
        h.update(f"{rel.as_posix()}\0{p.stat().st_size}\0".encode())
        with open(p, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
        n += 1
    return h.hexdigest(), n


def promoted_info(promoted: Path) -> dict | None:
    """The promoted model's metrics.json, or None when nothing was promoted yet."""
    path = promoted / "metrics.json"
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise PipelineError(f"{path}: unreadable ({exc}); move {promoted} aside to start over") from None


def holdout_accuracy(model: Path, paths, num_classes: int) -> dict:
    """Accuracy of an inference model on the current user holdout and global test set."""
    import odt_ops
    from pipeline import training

    sess = odt_ops.InferenceSession(model)
    (inp,) = sess.input_names()
    out = {}
    for name in ("user_holdout", "global_test"):
        split = training.load_split(paths, name)
        logits = training.batched(lambda x, t: sess.run(None, {inp: x})[0], split.x, split.y, 512)
        out[name] = training.classification(logits, split.y, num_classes)["accuracy"]
    return out


def promote(files: dict[str, Path], info: dict, promoted: Path, versions: Path) -> Path:
    """Write a new version in full, then point ``promoted`` (a symlink) at it in one rename."""
    from pipeline.io import atomic_write_text

    versions.mkdir(parents=True, exist_ok=True)
    version = versions / info["job"]["id"]
    staging = versions / f".{version.name}.staging"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    for name, src in files.items():
        shutil.copyfile(src, staging / name)
        with open(staging / name, "rb") as f:
            os.fsync(f.fileno())
    atomic_write_text(staging / "metrics.json", json.dumps(info, indent=2, sort_keys=True) + "\n")
    os.replace(staging, version)
    if promoted.exists() and not promoted.is_symlink():  # a plain folder from elsewhere: keep it as a version
        os.replace(promoted, versions / f"legacy-{_stamp()}")
    link = promoted.parent / f".{promoted.name}.link-{os.getpid()}"
    with contextlib.suppress(FileNotFoundError):
        link.unlink()
    os.symlink(os.path.relpath(version, promoted.parent), link)
    os.replace(link, promoted)  # atomic: readers see the old version or the new one
    _prune(versions, keep={version.name})
    return version


def _prune(versions: Path, keep: set[str]) -> None:
    for leftover in versions.glob(".*.staging"):  # from an interrupted promotion
        shutil.rmtree(leftover, ignore_errors=True)
    done = sorted((p for p in versions.iterdir() if p.is_dir() and not p.name.startswith(".")), key=lambda p: p.name)
    for old in done[:-KEEP_VERSIONS]:
        if old.name not in keep:
            shutil.rmtree(old, ignore_errors=True)


def _now() -> str:
    return dt.datetime.now().astimezone().isoformat(timespec="seconds")


def _stamp() -> str:
    return dt.datetime.now().strftime("%Y%m%d-%H%M%S")


def _flat(path: Path) -> dict:
    from pipeline.io import flatten

    return flatten(json.loads(path.read_text()))


# --------------------------------------------------------------------------- the job


@dataclass
class Decision:
    promote: bool
    reason: str
    candidate: float
    current: float
    current_model: str  # promoted | base


def decide(cfg, candidate: dict, current: dict, current_model: str) -> Decision:
    """Promote when the candidate does not regress against the model in service."""
    r = cfg.retrain
    cand, cur = candidate["user_holdout.personalized.accuracy"], current["user_holdout"]
    forgetting = candidate["forgetting"]
    what = "the promoted model" if current_model == "promoted" else "the pretrained base (nothing promoted yet)"
    if cand < cur + r.min_delta:
        need = f" + min_delta {r.min_delta:g}" if r.min_delta else ""
        return Decision(False, f"holdout accuracy {cand:.4f} < {cur:.4f}{need} of {what}: it would regress", cand, cur, current_model)
    if r.max_forgetting is not None and forgetting > r.max_forgetting:
        return Decision(False, f"it forgets {100 * forgetting:.1f} points of global test accuracy, more than retrain.max_forgetting="
                               f"{r.max_forgetting:g}", cand, cur, current_model)
    return Decision(True, f"holdout accuracy {cand:.4f} >= {cur:.4f} of {what}", cand, cur, current_model)


def run_job(cfg, overrides: Sequence[str], *, force: bool, root: Path) -> int:
    from pipeline import tracking, training
    from pipeline.io import sha256_file
    from pipeline.paths import Paths

    r = cfg.retrain
    paths = Paths(root)
    inbox, promoted, state = paths.resolve(r.inbox), paths.resolve(r.promoted_dir), paths.resolve(r.state_dir)
    digest, n_files = inbox_digest(inbox)
    info = promoted_info(promoted)
    last = _last(state)
    shown = f"{paths.show(inbox)} ({n_files} file(s), sha256 {digest[:12]})"
    if not force:
        if info is not None and info["job"]["inbox_sha256"] == digest:
            print(f"retrain: no new device data in {shown} since the model promoted at {info['job']['time']}; nothing to do")
            return 0
        if last and last.get("inbox_sha256") == digest and last.get("decision") == "kept":
            print(f"retrain: the device data in {shown} was already tried at {last['time']} and the model kept "
                  f"({last['reason']}); nothing to do (--force retries)")
            return 0

    init: list[str] = []
    if info is not None and r.continue_from_promoted:
        ckpt = promoted / "checkpoint"
        init = [f"train.init_checkpoint='{paths.show(ckpt)}'", f"train.init_sha256='{sha256_file(ckpt)}'"]
    else:
        init = ["train.init_checkpoint=null", "train.init_sha256=null"]
    job_id = f"retrain-{_stamp()}"
    record = {"id": job_id, "time": _now(), "inbox": paths.show(inbox), "inbox_sha256": digest, "inbox_files": n_files,
              "continued_from": paths.show(promoted / "checkpoint") if info is not None and r.continue_from_promoted else None,
              "git_commit": tracking.git_commit(root), "overrides": list(overrides)}
    print(f"retrain: new device data in {shown}; running the pipeline as experiment {job_id}"
          + (f", continuing from {record['continued_from']}" if record["continued_from"] else ""))
    with tracking.stage_run("retrain", cfg, config_source="retrain: " + " ".join(overrides)) as tracker:
        record["mlflow_run_id"] = tracker.run_id
        tracker.set_tags({"retrain.job": job_id, "retrain.inbox_sha256": digest, "dvc.exp": job_id})
        env = dict(os.environ, DVC_NO_ANALYTICS="1", ODT_PYTHON=os.environ.get("ODT_PYTHON") or sys.executable)  # stages: this python
        if tracker.run_id:
            env[tracking.PARENT_ENV] = tracker.run_id
        sets = [*overrides, *init]
        cmd = [sys.executable, "-m", "dvc", "exp", "run", "-n", job_id, *[a for s in sets for a in ("-S", s)]]
        code = _run(cmd, root, env)
        if code != 0:
            reason = f"the pipeline failed (dvc exp run exited {code}; the output above names the stage)"
            _log(state, {**record, "decision": "failed", "reason": reason})
            tracker.set_tags({"retrain.decision": "failed", "retrain.reason": reason})
            raise JobError(reason + f"; the promoted model is unchanged{' (' + paths.show(promoted) + ')' if info else ''}")

        candidate = _flat(paths.metrics("evaluate"))
        if info is not None:
            current = holdout_accuracy(promoted / "inference.onnx", paths, cfg.data.num_classes)
            current_model = "promoted"
        else:
            current = {"user_holdout": candidate["user_holdout.base.accuracy"], "global_test": candidate["global_test.base.accuracy"]}
            current_model = "base"
        d = decide(cfg, candidate, current, current_model)
        record.update({"decision": "promoted" if d.promote else "kept", "reason": d.reason,
                       "candidate_user_holdout_accuracy": d.candidate, "current_user_holdout_accuracy": d.current,
                       "current_model": d.current_model, "candidate_forgetting": candidate["forgetting"]})
        tracker.log_metrics({"candidate.user_holdout.accuracy": d.candidate, "current.user_holdout.accuracy": d.current,
                             "candidate.global_test.accuracy": candidate["global_test.personalized.accuracy"],
                             "current.global_test.accuracy": current["global_test"], "candidate.forgetting": candidate["forgetting"],
                             "promoted": int(d.promote)})
        tracker.set_tags({"retrain.decision": record["decision"], "retrain.reason": d.reason})
        if d.promote:
            files = {p.name: p for p in (paths.inference_model, paths.model_diff, paths.trained_checkpoint)}
            # the promoted model in MLflow's registry, its in-service alias moved to the new version
            model_uri = tracker.log_onnx_model(files["inference.onnx"], training.load_split(paths, "user_holdout").x[:2])
            if model_uri:
                record["registry_version"] = tracker.register_model(model_uri, cfg.tracking.registered_model,
                                                                    tracking.IN_SERVICE_ALIAS)
            version = promote(files, {"job": record, "evaluate": json.loads(paths.metrics("evaluate").read_text())},
                              promoted, state / "models")
            record["version"] = paths.show(version)
        _log(state, record)
        for path in (root / "params.yaml", root / "dvc.lock", paths.metrics("evaluate"), promoted / "metrics.json"):
            tracker.log_artifact(path, "job")
    verb = "promoted" if d.promote else "kept the current model"
    print(f"retrain: {verb}: {d.reason}" + (f" -> {paths.show(promoted)}/" if d.promote else f"; {paths.show(promoted)}/ unchanged"
                                             if info is not None else ""))
    return 0


def _run(cmd: list[str], root: Path, env: dict) -> int:
    """Run DVC in its own process group; an interrupt stops it and is re-raised."""
    proc = subprocess.Popen(cmd, cwd=root, env=env, start_new_session=True)
    try:
        return proc.wait()
    except BaseException:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        raise


def _last(state: Path) -> dict | None:
    path = state / "last.json"
    try:
        return json.loads(path.read_text()) if path.is_file() else None
    except (OSError, ValueError):
        return None


def _log(state: Path, record: dict) -> None:
    from pipeline.io import atomic_write_text

    state.mkdir(parents=True, exist_ok=True)
    line = json.dumps(record, sort_keys=True)
    with open(state / "history.jsonl", "a", encoding="utf-8") as f:
        f.write(line + "\n")
    atomic_write_text(state / "last.json", json.dumps(record, indent=2, sort_keys=True) + "\n")


# --------------------------------------------------------------------------- entry point


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in args):
        print(__doc__)
        return 0
    force = "--force" in args
    args = [a for a in args if a != "--force"]
    wait = None
    if "--wait" in args:
        i = args.index("--wait")
        try:
            wait = float(args[i + 1])
        except (IndexError, ValueError):
            print("retrain: error: --wait takes a number of seconds", file=sys.stderr)
            return 2
        del args[i : i + 2]
    previous = signal.signal(signal.SIGTERM, _terminate)  # a scheduler's stop is an interrupt: clean up, keep the model
    try:
        from odt_ops.errors import OdtError
        from pipeline import config
        from pipeline.paths import project_root

        try:
            cfg = config.load(args)
            root = project_root()
            with job_lock(Path(root) / cfg.retrain.state_dir / "lock", cfg.retrain.wait_seconds if wait is None else wait):
                return run_job(cfg, args, force=force, root=Path(root))
        except Busy as exc:
            print(f"retrain: {exc}; exiting (a scheduler retries later; --wait SECONDS waits for it)", file=sys.stderr)
            return EXIT_BUSY
        except PipelineError as exc:
            print(f"retrain: error: {exc}", file=sys.stderr)
            return exc.exit_code
        except OdtError as exc:
            print(f"retrain: error: {exc}", file=sys.stderr)
            return EXIT_INPUT
        except KeyboardInterrupt:
            print("retrain: interrupted; the promoted model is unchanged", file=sys.stderr)
            return 130
    finally:
        signal.signal(signal.SIGTERM, previous)


def _terminate(signum, frame):
    raise KeyboardInterrupt


if __name__ == "__main__":  # run the imported pipeline.<module>, whose classes the configuration holds (pipeline/stage.py)
    sys.exit(importlib.import_module(__spec__.name).main())
