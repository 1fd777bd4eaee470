"""Scheduled retraining: the job cron, a systemd timer or CI calls.

    python -m pipeline.retrain [--force] [--wait SECONDS] [OVERRIDE ...]

One job is five steps, under the job lock (``<retrain.state_dir>/lock``, see
pipeline/promotion.py; a second job waits ``--wait``/``retrain.wait_seconds`` seconds,
then exits 75, EX_TEMPFAIL):

1. ``find_new_data``: the inbox (``retrain.inbox``, data/user or a folder in it) is
   hashed (its SHA256SUMS-style listing: dotfiles and READMEs aside). No files, or the
   hash of the promoted model's data or of the last candidate kept out: nothing to do
   (``--force`` retries kept data). The inbox is the data the job trains on:
   ``data.user_data`` is set to it (a ``data.user_data`` outside the inbox is refused
   naming the key), and a folder whose format is unclear is refused naming
   ``data.user_format``.
2. ``run_experiment``: ``dvc exp run --temp evaluate export`` (``dvc exp show`` lists
   every job; the workspace, params.yaml and dvc.lock included, is left as it was; the
   federate stage is not the job's), the inbox copied into the temporary copy, continuing from the promoted checkpoint
   (``train.init_checkpoint``/``train.init_sha256``) rather than from the pretrained
   model; the job's overrides are passed on as ``-S``. The candidate's files are read
   back from the experiment through DVC.
3. ``decide``: the candidate against the model in service on the candidate's holdout
   (the promoted ``inference.onnx``, or before any promotion the pretrained base):
   promote when its accuracy is at least the current one's plus ``retrain.min_delta``
   (and, with ``retrain.max_forgetting``, it forgot at most that much global test
   accuracy); otherwise keep the current model, saying why.
4. ``promote``: the model in MLflow's registry (alias ``in-service``) and as a new
   version behind the ``retrain.promoted_dir`` link (pipeline/promotion.py).
5. ``record``: ``<state_dir>/history.jsonl``, and the job's MLflow run (the stage runs
   nested under it): the decision, both accuracies, the inbox as the run's training
   dataset (digest = the inbox's sha256), the experiment's params.yaml and dvc.lock.

Exit codes: 0 promoted, kept or nothing new; 1 the pipeline or an input failed; 2 bad
configuration; 75 another job holds the lock; 130 interrupted.
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from pipeline import promotion
from pipeline.config.schema import MISSING, Section
from pipeline.errors import EXIT_INPUT, ConfigError, PipelineError
from pipeline.promotion import Busy, job_lock, now, promoted_info, stamp

EXIT_BUSY = 75
# what the job reads back from its experiment: the files it promotes, and what decide compares
CANDIDATE_FILES = {"inference.onnx": "data/export/inference.onnx", "model.odtdiff": "data/export/model.odtdiff",
                   "checkpoint": "data/train/checkpoint"}
TARGETS = ("evaluate", "export")  # the stages whose outputs the job reads (and theirs upstream; federate is not the job's)
EXPERIMENT_FILES = ("data/evaluate/metrics.json", "data/prepare/user_holdout.npz", "data/prepare/global_test.npz",
                    "params.yaml", "dvc.lock")


@dataclass
class RetrainConfig(Section):
    """The job's ``retrain`` section (no stage lists it as a DVC param: it never reruns a stage)."""

    inbox: str = MISSING
    promoted_dir: str = MISSING
    state_dir: str = MISSING
    continue_from_promoted: bool = MISSING
    min_delta: float = MISSING
    max_forgetting: float | None = MISSING
    wait_seconds: float = MISSING

    def check(self) -> None:
        for key in ("inbox", "promoted_dir", "state_dir"):
            self.need(bool(getattr(self, key)), key, "a path relative to the repository")
        self.need(abs(self.min_delta) < float("inf"), "min_delta", "a finite number (accuracy points as a fraction)")
        self.need(self.max_forgetting is None or 0 <= self.max_forgetting < float("inf"), "max_forgetting",
                  "null or a finite number >= 0 (accuracy points as a fraction)")
        self.need(0 <= self.wait_seconds < float("inf"), "wait_seconds", "a finite number >= 0 (0: exit at once when a job is running)")


CONFIG = {"retrain": RetrainConfig}


class JobError(PipelineError):
    """The pipeline failed inside the job; the promoted model is unchanged."""


def inbox_digest(inbox: Path) -> tuple[str, int]:
    """The inbox's SHA-256 and its number of data files: the sha256 of its ``sha256sum``
    listing (``<sha256>  <relative path>`` per file, sorted by path), so anyone can
    recompute it: ``cd data/user && sha256sum <files, sorted> | sha256sum``."""
    from pipeline import datasets
    from pipeline.io import sums_text

    files = datasets.user_files(inbox)
    base = inbox.parent if inbox.is_file() else inbox
    return hashlib.sha256(sums_text(base, files).encode()).hexdigest(), len(files)


# --------------------------------------------------------------------------- the steps


@dataclass
class Job:
    """What the steps share: the job's identity and record, the paths, the settings."""

    cfg: object
    overrides: list[str]
    paths: object  # pipeline.paths.Paths
    id: str = field(default_factory=lambda: f"retrain-{stamp()}")
    record: dict = field(default_factory=dict)

    @property
    def inbox(self) -> Path:
        return self.paths.resolve(self.cfg.retrain.inbox)

    @property
    def promoted(self) -> Path:
        return self.paths.resolve(self.cfg.retrain.promoted_dir)

    @property
    def state(self) -> Path:
        return self.paths.resolve(self.cfg.retrain.state_dir)


@dataclass
class NewData:
    digest: str
    files: int
    user_data: str  # data.user_data for the experiment: the inbox or the file in it
    user_format: str


def find_new_data(job: Job, *, force: bool) -> NewData | None:
    """The inbox's data when it is new (None, said in one line, when there is nothing to
    do); ConfigError/DataError naming the key when the experiment could not train on it."""
    from pipeline import datasets

    paths, inbox, data = job.paths, job.inbox, job.cfg.data
    _inside_user_folder(job)
    digest, n = inbox_digest(inbox)
    shown = f"{paths.show(inbox)} ({n} file(s), sha256 {digest[:12]})"
    info, last = promoted_info(job.promoted), _last(job.state)
    if n == 0:
        print(f"retrain: no device data in {shown}; nothing to do (put labelled samples there: data/user/README.md)")
        return None
    if not force and info is not None and info["job"]["inbox_sha256"] == digest:
        print(f"retrain: no new device data in {shown} since the model promoted at {info['job']['time']}; nothing to do")
        return None
    if not force and last and last.get("inbox_sha256") == digest and last.get("decision") == "kept":
        print(f"retrain: the device data in {shown} was already tried at {last['time']} and the model kept "
              f"({last['reason']}); nothing to do (--force retries)")
        return None
    user_data = data.user_data or paths.show(inbox)
    target = paths.resolve(user_data).resolve()
    if target != inbox.resolve() and inbox.resolve() not in target.parents:
        raise ConfigError(f"data.user_data={data.user_data}: outside the inbox retrain.inbox={job.cfg.retrain.inbox} whose new files "
                          "triggered this job; set data.user_data=null (the job trains on the inbox) or retrain.inbox to your data")
    fmt = data.user_format.value
    if target.is_dir():
        fmt = datasets.folder_format(target, fmt)  # DataError naming data.user_format when mixed
        if fmt is None:
            raise ConfigError(f"data.user_format={data.user_format.value}: {paths.show(target)} holds no such data; "
                              "set data.user_format=auto or to the kind of data it holds")
    job.record.update({"inbox": paths.show(inbox), "inbox_sha256": digest, "inbox_files": n, "user_data": user_data})
    print(f"retrain: new device data in {shown}; training on it (data.user_data={user_data}) as experiment {job.id}")
    return NewData(digest, n, user_data, fmt)


def _inside_user_folder(job: Job) -> None:
    """The inbox is prepare's DVC dependency (data/user or a folder in it), so new files
    rerun prepare, and it is copied into the experiment's temporary copy."""
    user, inbox = job.paths.user_folder.resolve(), job.inbox.resolve()
    if inbox != user and user not in inbox.parents:
        raise ConfigError(f"retrain.inbox={job.cfg.retrain.inbox}: must be {job.paths.show(job.paths.user_folder)} or a folder in it "
                          "(prepare's DVC dependency, so new files rerun prepare)")


@dataclass
class Candidate:
    """The experiment's outputs, read back from DVC into ``root`` (data/<stage>/ layout)."""

    rev: str
    root: Path
    metrics: dict

    def file(self, rel: str) -> Path:
        return self.root / rel


def run_experiment(job: Job, new: NewData, env: dict) -> Candidate:
    """``dvc exp run --temp`` on the inbox, continuing from the promoted model; the
    workspace is left as it was. Raises JobError naming what failed."""
    from pipeline.io import flatten, sha256_file

    paths, r = job.paths, job.cfg.retrain
    info = promoted_info(job.promoted)
    if info is not None and r.continue_from_promoted:
        ckpt = (job.promoted / "checkpoint").resolve()  # the version itself: the temporary copy has no data/promoted
        init = [f"train.init_checkpoint='{ckpt}'", f"train.init_sha256='{sha256_file(ckpt)}'"]
        job.record["continued_from"] = paths.show(job.promoted / "checkpoint")
        print(f"retrain: continuing from {job.record['continued_from']}")
    else:
        init = ["train.init_checkpoint=null", "train.init_sha256=null"]
        job.record["continued_from"] = None
    sets = [*job.overrides, f"data.user_data='{new.user_data}'", f"data.user_format={new.user_format}", *init]
    copies = [a for rel in _untracked(paths.root, job.inbox) for a in ("-C", rel)]  # git's stash carries the tracked ones
    cmd = [sys.executable, "-m", "dvc", "exp", "run", "--temp", *copies, "-n", job.id, *[a for s in sets for a in ("-S", s)], *TARGETS]
    code, stage_error = _run(cmd, paths.root, env)
    _tracking_written()
    if code != 0:
        raise JobError(f"the pipeline failed: {stage_error}" if stage_error else
                       f"the pipeline failed (dvc exp run exited {code}; the output above names the stage)")
    rev = _experiment_rev(paths.root, job.id)
    root = job.state / f".candidate-{job.id}"
    shutil.rmtree(root, ignore_errors=True)
    _read_experiment(paths.root, rev, [*CANDIDATE_FILES.values(), *EXPERIMENT_FILES], root)
    job.record["experiment_rev"] = rev
    return Candidate(rev, root, flatten(json.loads((root / "data/evaluate/metrics.json").read_text())))


def _tracking_written() -> None:
    """The experiment's stage runs are in MLflow (DVC's stages spool them: pipeline.mlflow_logger)
    before the job nests, promotes or reports; one that could not be written is a warning."""
    from pipeline import mlflow_logger

    for line in mlflow_logger.wait():
        print(f"retrain: warning: not written to MLflow: {line}", file=sys.stderr)


def _untracked(root: Path, folder: Path) -> list[str]:
    """The files and folders under ``folder`` git does not track, untracked folders as one
    entry: what ``dvc exp run --temp -C`` must copy into the temporary copy."""
    out = subprocess.run(["git", "ls-files", "--others", "--directory", "-z", "--", str(folder)], cwd=root,
                         capture_output=True, text=True, check=True).stdout
    return [p.rstrip("/") for p in out.split("\0") if p]


def _experiment_rev(root: Path, name: str) -> str:
    """The commit of DVC experiment ``name`` (refs/exps/.../<name>)."""
    out = subprocess.run(["git", "for-each-ref", "--format=%(objectname) %(refname)", "refs/exps/"], cwd=root,
                         capture_output=True, text=True, check=True).stdout
    revs = [line.split()[0] for line in out.splitlines() if line.endswith(f"/{name}")]
    if len(revs) != 1:
        raise JobError(f"dvc exp run finished but left {len(revs)} experiment(s) named {name} (git for-each-ref refs/exps/)")
    return revs[0]


def _read_experiment(root: Path, rev: str, files: Sequence[str], dest: Path) -> None:
    """Copy ``files`` as experiment ``rev`` has them (git's or DVC's cache) under ``dest``."""
    from dvc.api import DVCFileSystem

    fs = DVCFileSystem(str(root), rev=rev)
    for rel in files:
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        fs.get_file(rel, str(dest / rel))


@dataclass
class Decision:
    promote: bool
    reason: str
    candidate: float
    current: float
    current_model: str  # promoted | base


def current_accuracy(job: Job, candidate: Candidate) -> tuple[dict, str]:
    """The model in service on the candidate's holdout and global test set."""
    if promoted_info(job.promoted) is None:
        m = candidate.metrics
        return {"user_holdout": m["user_holdout.base.accuracy"], "global_test": m["global_test.base.accuracy"]}, "base"
    return holdout_accuracy(job.promoted / "inference.onnx", _paths(candidate), job.cfg.data.num_classes), "promoted"


def holdout_accuracy(model: Path, paths, num_classes: int) -> dict:
    """Accuracy of an inference model on ``paths``' user holdout and global test set."""
    import odt_ops
    from pipeline import inputs, scoring

    sess = odt_ops.InferenceSession(model)
    (inp,) = sess.input_names()
    out = {}
    for name in ("user_holdout", "global_test"):
        split = inputs.load_split(paths, name)
        logits = scoring.batched(lambda x, t: sess.run(None, {inp: x})[0], split.x, split.y, 512)
        out[name] = scoring.classification(logits, split.y, num_classes)["accuracy"]
    return out


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


def promote(job: Job, candidate: Candidate, tracker) -> None:
    """The candidate into MLflow's registry (alias in-service) and behind the promoted link."""
    from pipeline import inputs, tracking

    files = {name: candidate.file(rel) for name, rel in CANDIDATE_FILES.items()}
    model_uri = tracker.log_onnx_model(files["inference.onnx"], inputs.load_split(_paths(candidate), "user_holdout").x[:2])
    if model_uri:
        job.record["registry_version"] = tracker.register_model(model_uri, job.cfg.tracking.registered_model, tracking.IN_SERVICE_ALIAS)
    evaluation = json.loads(candidate.file("data/evaluate/metrics.json").read_text())
    version = promotion.promote(files, {"job": job.record, "evaluate": evaluation}, job.promoted, job.state / "models")
    job.record["version"] = job.paths.show(version)


def record(job: Job, tracker, candidate: Candidate | None = None) -> None:
    """The decision in history.jsonl/last.json and on the job's MLflow run."""
    from pipeline.io import atomic_write_text

    r = job.record
    job.state.mkdir(parents=True, exist_ok=True)
    with open(job.state / "history.jsonl", "a", encoding="utf-8") as f:
        f.write(json.dumps(r, sort_keys=True) + "\n")
    atomic_write_text(job.state / "last.json", json.dumps(r, indent=2, sort_keys=True) + "\n")
    tracker.set_tags({"retrain.decision": r["decision"], "retrain.reason": r["reason"]})
    if candidate is not None:
        for rel in ("params.yaml", "dvc.lock", "data/evaluate/metrics.json"):
            tracker.log_artifact(candidate.file(rel), "job")
    if tracker.enabled and "inbox_sha256" in r:
        _log_inbox_dataset(tracker.run_id, job)


def _log_inbox_dataset(run_id: str, job: Job) -> None:
    """The inbox as the job run's training dataset: the run the registered version comes
    from names the data it learnt (MLflow keeps 36 characters of a digest; the profile
    holds the whole sha256)."""
    from mlflow import MlflowClient
    from mlflow.entities import Dataset, DatasetInput, InputTag

    from pipeline import tracking

    r = job.record
    dataset = Dataset(name="inbox", digest=r["inbox_sha256"][:36], source_type="local", source=json.dumps({"uri": r["inbox"]}),
                      profile=json.dumps({"sha256": r["inbox_sha256"], "files": r["inbox_files"]}))
    MlflowClient(tracking.tracking_uri()).log_inputs(run_id, datasets=[DatasetInput(dataset, [InputTag("mlflow.data.context", "training")])])


def run_job(cfg, overrides: Sequence[str], *, force: bool, root: Path) -> int:
    from pipeline import tracking
    from pipeline.paths import Paths

    job = Job(cfg, list(overrides), Paths(root))
    new = find_new_data(job, force=force)
    if new is None:
        return 0
    job.record.update({"id": job.id, "time": now(), "git_commit": tracking.git_commit(root), "overrides": job.overrides})
    candidate = None
    with tracking.stage_run("retrain", cfg, config_source="retrain: " + " ".join(overrides)) as tracker:
        job.record["mlflow_run_id"] = tracker.run_id
        tracker.set_tags({"retrain.job": job.id, "retrain.inbox_sha256": new.digest, "dvc.exp": job.id})
        env = dict(os.environ, DVC_NO_ANALYTICS="1", ODT_PYTHON=os.environ.get("ODT_PYTHON") or sys.executable)  # stages: this python
        if tracker.run_id:
            env[tracking.PARENT_ENV] = tracker.run_id
        try:
            candidate = run_experiment(job, new, env)
            current, current_model = current_accuracy(job, candidate)
            d = decide(cfg, candidate.metrics, current, current_model)
            _note_decision(job, tracker, d, candidate.metrics, current)
            if d.promote:
                promote(job, candidate, tracker)
            record(job, tracker, candidate)
        except JobError as exc:
            job.record.update({"decision": "failed", "reason": str(exc)})
            record(job, tracker)
            raise JobError(f"{exc}; the promoted model is unchanged") from None
        finally:
            if candidate is not None:
                shutil.rmtree(candidate.root, ignore_errors=True)
    shown = job.paths.show(job.promoted)
    if d.promote:
        print(f"retrain: promoted: {d.reason} -> {shown}/")
    else:
        print(f"retrain: kept the current model: {d.reason}" + (f"; {shown}/ unchanged" if current_model == "promoted" else ""))
    return 0


def _note_decision(job: Job, tracker, d: Decision, candidate: dict, current: dict) -> None:
    job.record.update({"decision": "promoted" if d.promote else "kept", "reason": d.reason,
                       "candidate_user_holdout_accuracy": d.candidate, "current_user_holdout_accuracy": d.current,
                       "current_model": d.current_model, "candidate_forgetting": candidate["forgetting"]})
    tracker.log_metrics({"candidate.user_holdout.accuracy": d.candidate, "current.user_holdout.accuracy": d.current,
                         "candidate.global_test.accuracy": candidate["global_test.personalized.accuracy"],
                         "current.global_test.accuracy": current["global_test"],
                         "candidate.forgetting": candidate["forgetting"], "promoted": int(d.promote)})


def _paths(candidate: Candidate):
    from pipeline.paths import Paths

    return Paths(candidate.root)


# a stage's one-line error as pipeline/stage.py prints it (``prepare: error: data/user/x.npz: ...``)
STAGE_ERROR = re.compile(r"^(?P<stage>[a-z_]+): error: .+")


def _run(cmd: list[str], root: Path, env: dict) -> tuple[int, str | None]:
    """Run DVC in its own process group, its output passed through line by line; (exit code, the
    last stage error line it printed, which the job's record keeps: a cron log is read later, if at
    all). An interrupt stops it and is re-raised."""
    proc = subprocess.Popen(cmd, cwd=root, env=env, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, errors="replace")
    stage_error = None
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            sys.stdout.write(line)
            sys.stdout.flush()
            if STAGE_ERROR.match(line):
                stage_error = line.strip()
        return proc.wait(), stage_error
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


# --------------------------------------------------------------------------- entry point


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m pipeline.retrain", description=__doc__.split("\n\n")[0],
                                epilog="Every other argument is a Hydra override of conf/ (key=value, group=option), "
                                       "passed on to the experiment as dvc exp run -S.")
    p.add_argument("--force", action="store_true", help="retrain on data whose candidate was kept out before")
    p.add_argument("--wait", type=float, metavar="SECONDS", help="wait this long for a running job (default: retrain.wait_seconds)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args, overrides = parser().parse_known_args(sys.argv[1:] if argv is None else argv)
    unknown = [a for a in overrides if a.startswith("-")]
    if unknown:
        parser().error(f"unrecognized arguments: {' '.join(unknown)} (overrides are key=value)")
    previous = signal.signal(signal.SIGTERM, _terminate)  # a scheduler's stop is an interrupt: clean up, keep the model
    try:
        from odt_ops.errors import OdtError
        from pipeline import config
        from pipeline.paths import project_root

        try:
            cfg = config.load(overrides)
            root = project_root()
            with job_lock(Path(root) / cfg.retrain.state_dir / "lock", cfg.retrain.wait_seconds if args.wait is None else args.wait):
                return run_job(cfg, overrides, force=args.force, root=Path(root))
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
