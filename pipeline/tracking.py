"""MLflow tracking for the stages: one run per stage, nested under one pipeline run.

- Store: ``$MLFLOW_TRACKING_URI`` if set, else ``sqlite:///<tracking root>/mlflow.db``
  (the repository; the *original* one for DVC experiments run in temporary copies, via
  ``DVC_ROOT``). An absolute path, never MLflow's cwd-relative default.
- Experiment: ``tracking.experiment``, created with an explicit artifact location
  (``mlartifacts/`` beside a SQLite store) so it never depends on a process's cwd.
- Parent: ``$ODT_PARENT_RUN_ID`` names the pipeline run to nest under (not
  ``MLFLOW_RUN_ID``, which resumes a run). Without it, stages that one ``dvc repro`` /
  ``dvc exp run`` invocation runs share a parent found or created by a key of that DVC
  process; a stage run by hand is a top-level run.
- Each stage run gets its flattened configuration as params, the tags ``odt.stage``,
  ``dvc.stage``, ``dvc.exp``, ``dvc.baseline_rev``, ``git.commit``, step metrics and its
  artifacts.
- Who writes them: a stage's tracker only records (``RecordingRun``; the records and what
  MLflow makes of each: pipeline.mlflow_writer). Under DVC the records are spooled and ONE
  logging process per DVC command writes them (pipeline.mlflow_logger): ``import mlflow``
  costs 2 s of CPU, once instead of once per stage, and overlaps the stages' work; a stage
  run by hand (and the retraining job) writes its own before it returns.
  ``python -m pipeline.mlflow_logger --wait`` returns when every spooled run is in MLflow.

This module never imports mlflow: stages run with ``tracking=disabled``, or under DVC, never do.
"""
from __future__ import annotations

import contextlib
import os
import subprocess
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.config.schema import MISSING, Section
from pipeline.mlflow_writer import (  # noqa: F401 (MLflow's names, read by users of this module; mlflow not imported)
    EXPERIMENT_KIND,
    EXPERIMENT_KIND_TAG,
    PARENT_ENV,
    PIPELINE_KEY_TAG,
    artifact_location,
    first_line,
)
from pipeline.paths import project_root, tracking_root


@dataclass
class TrackingConfig(Section):
    """The ``tracking`` section (no stage lists it as a DVC param: it never reruns a stage)."""

    enabled: bool = MISSING
    experiment: str = MISSING
    log_artifacts: bool = MISSING
    registered_model: str = MISSING  # the model registry's name for what the retraining job promotes

    def check(self) -> None:
        self.need(bool(self.experiment), "experiment", "a non-empty experiment name")


CONFIG = {"tracking": TrackingConfig}

MODE_ENV = "ODT_TRACKING_MODE"  # "direct" or "spool" forces one; unset: spool under DVC, direct otherwise
IN_SERVICE_ALIAS = "in-service"  # the registry alias of the model the retraining job promoted
MAX_PARAM_LENGTH = 6000


def tracking_uri() -> str:
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{tracking_root() / 'mlflow.db'}"


class NullRun:
    """Stands in for a tracked run when tracking is disabled; every call is a no-op."""

    run_id: str | None = None
    parent_run_id: str | None = None

    def log_metric(self, key: str, value: float, step: int | None = None) -> None:
        pass

    def log_metrics(self, metrics: Mapping[str, Any], step: int | None = None) -> None:
        pass

    def log_params(self, params: Mapping[str, Any]) -> None:
        pass

    def set_tags(self, tags: Mapping[str, Any]) -> None:
        pass

    def log_artifact(self, path: str | os.PathLike, artifact_path: str | None = None) -> None:
        pass

    def log_parent_metrics(self, metrics: Mapping[str, Any]) -> None:
        pass

    def log_parent_artifact(self, path: str | os.PathLike, artifact_path: str | None = None) -> None:
        pass

    def log_datasets(self, datasets: Mapping[str, tuple[str | os.PathLike, str]], context: str) -> None:
        pass

    def log_plot(self, kind: str, name: str, spec: Mapping[str, Any], files: Mapping[str, str | os.PathLike]) -> None:
        pass

    def log_onnx_model(self, path: str | os.PathLike, input_example, name: str = "inference_model") -> str | None:
        return None

    def register_model(self, model_uri: str, name: str, alias: str) -> str | None:
        return None

    @property
    def enabled(self) -> bool:
        return self.run_id is not None


NO_TRACKING = NullRun()  # the stages' default tracker: every call a no-op (it holds no state)


class RecordingRun(NullRun):
    """A tracked run: every call becomes a record (pipeline.mlflow_writer lists them and
    what MLflow makes of each), handed to ``sink`` when the run ends: written in this
    process (DirectSink) or spooled for the DVC command's logging process
    (pipeline.mlflow_logger.SpoolSink). Timestamps are taken here, when things happen."""

    def __init__(self, start: dict, sink):
        self.start = start
        self.sink = sink
        self.records: list[dict] = []
        self._metrics: list[list] = []
        self.run_id, self.parent_run_id = sink.open(start)

    def log_metric(self, key: str, value: float, step: int | None = None) -> None:
        self._metrics.append([key, float(value), _now_ms(), int(step or 0)])

    def log_metrics(self, metrics: Mapping[str, Any], step: int | None = None) -> None:
        for key, value in metrics.items():
            if _is_number(value):
                self.log_metric(key, value, step)

    def log_params(self, params: Mapping[str, Any]) -> None:
        self.sink.add(self, {"op": "params", "params": params_record(params)})

    def set_tags(self, tags: Mapping[str, Any]) -> None:
        self.sink.add(self, {"op": "tags", "tags": {k: str(v) for k, v in tags.items()}})

    def log_artifact(self, path: str | os.PathLike, artifact_path: str | None = None, *, run: str = "self") -> None:
        if self.start["log_artifacts"] and Path(path).exists():
            self.sink.add(self, {"op": "artifact", "run": run, "path": self.sink.keep(path), "artifact_path": artifact_path})

    def log_parent_metrics(self, metrics: Mapping[str, Any]) -> None:
        """Headline metrics on the pipeline run too, so its row in the UI shows them."""
        now = _now_ms()
        rows = [[k, float(v), now, 0] for k, v in metrics.items() if _is_number(v)]
        if rows:
            self.sink.add(self, {"op": "metrics", "run": "parent", "metrics": rows})

    def log_parent_artifact(self, path: str | os.PathLike, artifact_path: str | None = None) -> None:
        if Path(path).is_file():
            self.log_artifact(path, artifact_path, run="parent")

    def log_datasets(self, datasets: Mapping[str, tuple[str | os.PathLike, str]], context: str) -> None:
        """Each ``name -> (npz file, source shown)`` as an MLflow dataset input of this run
        (its features ``x``: name, digest, source), with ``context`` (training, evaluation)."""
        items = [[name, self.sink.keep(npz), str(source)] for name, (npz, source) in datasets.items()]
        if items:
            self.sink.add(self, {"op": "datasets", "context": context, "items": items})

    def log_plot(self, kind: str, name: str, spec: Mapping[str, Any], files: Mapping[str, str | os.PathLike]) -> None:
        """A PNG ``name`` under ``plots/``, drawn by ``pipeline.plots.draw(kind, ...)`` from
        ``spec`` and the stage's ``files`` (drawn by whoever writes the records: matplotlib
        loads there, not in the stage)."""
        if self.start["log_artifacts"]:
            kept = {k: self.sink.keep(v) for k, v in files.items()}
            self.sink.add(self, {"op": "plot", "kind": kind, "name": name, "artifact_path": "plots", "spec": {**spec, **kept}})

    def log_onnx_model(self, path: str | os.PathLike, input_example, name: str = "inference_model") -> str | None:
        """The ONNX file as an MLflow model (onnx flavor, signature and input example); its
        ``runs:/`` URI when written now (DirectSink), None when spooled."""
        if not self.start["log_artifacts"]:
            return None
        return self.sink.model(self, {"op": "onnx_model", "path": self.sink.keep(path), "name": name}, input_example)

    def register_model(self, model_uri: str, name: str, alias: str) -> str | None:
        return self.sink.register(self, model_uri, name, alias)

    def close(self, status: str) -> None:
        if self._metrics:
            self.sink.add(self, {"op": "metrics", "run": "self", "metrics": self._metrics})
            self._metrics = []
        self.sink.close(self, {"op": "end", "status": status, "end_time": _now_ms()})


class DirectSink:
    """Writes in this process: the run is created when it opens (its id is MLflow's), files
    and models when logged (a model's URI is needed at once; a file may be gone later),
    params, tags and metrics when it closes."""

    def __init__(self):
        from pipeline.mlflow_writer import Writer

        self.writer = Writer()

    def open(self, start: dict) -> tuple[str, str | None]:
        self.ids = self.writer.start(start)
        return self.ids

    def keep(self, path: str | os.PathLike) -> str:
        return str(path)  # files are written as they are logged (add), while they exist

    def add(self, run: RecordingRun, rec: dict) -> None:
        """Params, tags and metrics wait for the run's end (a few batches); files go now."""
        if rec["op"] in ("params", "tags", "metrics"):
            run.records.append(rec)
        else:
            self.writer.write(run.start, *self.ids, [rec])

    def model(self, run: RecordingRun, rec: dict, input_example) -> str | None:
        import tempfile

        import numpy as np

        with tempfile.TemporaryDirectory(prefix="odt-example-") as tmp:
            np.save(Path(tmp) / "example.npy", np.asarray(input_example), allow_pickle=False)
            return self.writer.log_onnx_model(run.start["uri"], run.run_id, rec["path"], str(Path(tmp) / "example.npy"), rec["name"])

    def register(self, run: RecordingRun, model_uri: str, name: str, alias: str) -> str | None:
        return self.writer.register_model(run.start["uri"], run.run_id, model_uri, name, alias)

    def close(self, run: RecordingRun, end: dict) -> None:
        run_id, parent = self.ids
        try:
            self.writer.write(run.start, run_id, parent, run.records)
        finally:
            self.writer.end(run.start, run_id, parent, end)


def params_record(params: Mapping[str, Any]) -> dict[str, str]:
    return {str(k)[:250]: _param_value(v) for k, v in params.items()}


def _param_value(v: Any) -> str:
    text = "null" if v is None else str(v)
    return text if len(text) <= MAX_PARAM_LENGTH else text[:MAX_PARAM_LENGTH - 3] + "..."


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _now_ms() -> int:
    return int(time.time() * 1000)


def tracking_mode() -> str:
    """``spool`` (one logging process per DVC command writes the stages' records) under DVC,
    ``direct`` (this process writes them before it returns) otherwise; $ODT_TRACKING_MODE forces one."""
    forced = os.environ.get(MODE_ENV, "").strip().lower()
    if forced in ("direct", "spool"):
        return forced
    return "spool" if dvc_invocation_key() is not None else "direct"


def start_record(stage: str, cfg, *, config_source: str | None = None) -> dict:
    """The ``start`` record of ``stage``'s run: store, experiment, name, tags, the parent."""
    from pipeline.config import to_container
    from pipeline.io import flatten

    tags = {**run_tags(stage), "mlflow.source.name": f"pipeline.{stage}", "mlflow.source.type": "LOCAL"}
    if config_source:
        tags["odt.config_source"] = config_source
    parent = None
    if os.environ.get(PARENT_ENV):
        parent = {"id": os.environ[PARENT_ENV]}
    else:
        key = dvc_invocation_key()
        if key is not None:
            ptags = {"odt.stage": "pipeline", "mlflow.source.type": "LOCAL"}
            ptags.update({k: v for k, v in run_tags("pipeline").items() if k not in ("odt.stage", "dvc.stage")})
            # the pipeline's configuration, as every stage sees it (params of the run that makes it)
            parent = {"key": key, "name": pipeline_run_name(ptags), "tags": ptags, "params": params_record(flatten(to_container(cfg)))}
    return {"op": "start", "uri": tracking_uri(), "experiment": cfg.tracking.experiment, "run_name": stage, "tags": tags,
            "start_time": _now_ms(), "log_artifacts": bool(cfg.tracking.log_artifacts), "parent": parent}


@contextlib.contextmanager
def stage_run(stage: str, cfg, *, config_source: str | None = None) -> Iterator[NullRun]:
    """Open the MLflow run of ``stage`` (see the module docstring); yields a NullRun when
    ``cfg.tracking.enabled`` is false. The run ends FINISHED, or FAILED if the body raised
    (KILLED when interrupted)."""
    if not cfg.tracking.enabled:
        yield NullRun()
        return
    from pipeline.config import to_container
    from pipeline.io import flatten

    start = start_record(stage, cfg, config_source=config_source)
    if tracking_mode() == "spool":
        from pipeline.mlflow_logger import SpoolSink

        sink = SpoolSink(dvc_invocation_key())
    else:
        sink = DirectSink()
    tracker = RecordingRun(start, sink)
    status = "FAILED"
    try:
        tracker.log_params(flatten(to_container(cfg)))
        yield tracker
        status = "FINISHED"
    except KeyboardInterrupt:
        status = "KILLED"
        raise
    finally:
        tracker.close(status)


def run_tags(stage: str) -> dict[str, str]:
    """Stage, DVC experiment variables and the git commit, for filters like
    ``tags.`dvc.exp` = 'q-abs'``."""
    env = os.environ
    tags = {"odt.stage": stage, "dvc.stage": env.get("DVC_STAGE", "")}
    if env.get("DVC_EXP_NAME"):
        tags["dvc.exp"] = env["DVC_EXP_NAME"]
    if env.get("DVC_EXP_BASELINE_REV"):
        tags["dvc.baseline_rev"] = env["DVC_EXP_BASELINE_REV"]
    commit = git_commit()
    if commit:
        tags["git.commit"] = commit
        tags["mlflow.source.git.commit"] = commit
    return {k: v for k, v in tags.items() if v}


def pipeline_run_name(tags: Mapping[str, str]) -> str:
    """The pipeline run's name: the DVC experiment's (``dvc exp run -n lr-sweep``, or the name
    DVC made up), else ``repro@<commit>`` (``dvc repro``), with ``+changes`` when the working
    tree differs from that commit; ``pipeline`` outside git."""
    if tags.get("dvc.exp"):
        return tags["dvc.exp"]
    commit = tags.get("git.commit")
    if not commit:
        return "pipeline"
    return f"repro@{commit[:8]}" + ("+changes" if git_dirty() else "")


def git_dirty(root: Path | None = None) -> bool:
    """Tracked files differ from HEAD (outputs DVC writes into git-ignored places do not count)."""
    try:
        out = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root or project_root(),
                             capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return False
    return out.returncode == 0 and bool(out.stdout.strip())


def git_commit(root: Path | None = None) -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=root or project_root(), capture_output=True, text=True, timeout=10, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    return out.stdout.strip() or None


def dvc_invocation_key() -> str | None:
    """A key shared by every stage one DVC command runs, None outside DVC.

    DVC passes no invocation id to stages, so this is the id and start time of the
    nearest ancestor process that is DVC (``dvc repro``, ``dvc exp run``, a queue
    worker), plus the experiment name (a queue worker runs several). Linux (/proc) only.
    """
    if not os.environ.get("DVC_STAGE"):
        return None
    pid = os.getppid()
    for _ in range(16):
        if pid <= 1:
            return None
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return None
        fields_after_comm = stat.rsplit(")", 1)[1].split()
        if any(os.path.basename(arg.decode(errors="replace")) == "dvc" for arg in cmdline[:3]):
            start = fields_after_comm[19]  # field 22 of /proc/<pid>/stat: start time in clock ticks
            exp = os.environ.get("DVC_EXP_NAME", "")
            return f"dvc-{pid}-{start}" + (f"-{exp}" if exp else "")
        pid = int(fields_after_comm[1])  # field 4: the parent's pid
    return None
