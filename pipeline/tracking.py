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
  ``dvc.stage``, ``dvc.exp``, ``dvc.baseline_rev``, ``git.commit``, buffered step
  metrics (flushed with ``log_batch``) and its artifacts.

mlflow is imported lazily: importing this module costs nothing, and stages run with
``tracking=disabled`` never import it.
"""
from __future__ import annotations

import contextlib
import os
import subprocess
import time
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.config.schema import MISSING, Section
from pipeline.errors import TrackingError
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

PARENT_ENV = "ODT_PARENT_RUN_ID"
# MLflow 3 opens an experiment on its GenAI overview unless its kind says model training
EXPERIMENT_KIND_TAG, EXPERIMENT_KIND = "mlflow.experimentKind", "custom_model_development"
IN_SERVICE_ALIAS = "in-service"  # the registry alias of the model the retraining job promoted
PIPELINE_KEY_TAG = "odt.pipeline_key"
MAX_PARAM_LENGTH = 6000
BATCH = 1000  # MLflow's limit of metrics per log_batch call


def tracking_uri() -> str:
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{tracking_root() / 'mlflow.db'}"


def artifact_location(uri: str) -> str | None:
    """``mlartifacts/`` beside a SQLite store; None (the server decides) otherwise."""
    if uri.startswith("sqlite:///"):
        db = Path(uri.removeprefix("sqlite:///"))
        return (db.resolve().parent / "mlartifacts").as_uri()
    return None


class NullRun:
    """Stands in for a StageRun when tracking is disabled; every call is a no-op."""

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

    def flush(self) -> None:
        pass

    def wait(self) -> None:
        pass

    def log_datasets(self, datasets: Mapping[str, tuple[Any, str]], context: str) -> None:
        pass

    def log_onnx_model(self, path: str | os.PathLike, input_example, name: str = "inference_model") -> str | None:
        return None

    def register_model(self, model_uri: str, name: str, alias: str) -> str | None:
        return None

    @property
    def enabled(self) -> bool:
        return self.run_id is not None


NO_TRACKING = NullRun()  # the stages' default tracker: every call a no-op (it holds no state)


class StageRun(NullRun):
    """One MLflow run. Metrics are buffered and sent in batches (3.5 ms per single
    ``log_metric`` call on SQLite, 0.05 s per 1000 in a batch), params, tags and metrics
    asynchronously (MLflow's ``log_batch(synchronous=False)``: its queue writes them while
    the stage works); ``wait`` returns when all are written."""

    def __init__(self, client, run_id: str, parent_run_id: str | None, *, log_artifacts: bool = True):
        self.client = client
        self.run_id = run_id
        self.parent_run_id = parent_run_id
        self.log_artifacts = log_artifacts
        self._buffer: list = []
        self._pending: list = []  # MLflow's RunOperations of the asynchronous batches

    def _batch(self, run_id: str, **entities) -> None:
        self._pending.append(self.client.log_batch(run_id, synchronous=False, **entities))

    def wait(self) -> None:
        """Every asynchronous batch written (an error in one is raised here)."""
        self.flush()
        pending, self._pending = self._pending, []
        for operation in pending:
            operation.wait()

    def log_metric(self, key: str, value: float, step: int | None = None) -> None:
        from mlflow.entities import Metric

        self._buffer.append(Metric(key, float(value), int(time.time() * 1000), int(step or 0)))
        if len(self._buffer) >= BATCH:
            self.flush()

    def log_metrics(self, metrics: Mapping[str, Any], step: int | None = None) -> None:
        for key, value in metrics.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                self.log_metric(key, value, step)

    def log_params(self, params: Mapping[str, Any]) -> None:
        from mlflow.entities import Param

        items = [Param(str(k)[:250], _param_value(v)) for k, v in params.items()]
        for i in range(0, len(items), 100):
            self._batch(self.run_id, params=items[i:i + 100])

    def set_tags(self, tags: Mapping[str, Any]) -> None:
        from mlflow.entities import RunTag

        self._batch(self.run_id, tags=[RunTag(k, str(v)) for k, v in tags.items()])

    def log_artifact(self, path: str | os.PathLike, artifact_path: str | None = None) -> None:
        if not self.log_artifacts:
            return
        path = Path(path)
        if path.is_dir():  # as a folder of that name, like a file keeps its name
            self.client.log_artifacts(self.run_id, str(path), f"{artifact_path}/{path.name}" if artifact_path else path.name)
        elif path.is_file():
            self.client.log_artifact(self.run_id, str(path), artifact_path)

    def log_parent_metrics(self, metrics: Mapping[str, Any]) -> None:
        """Headline metrics on the pipeline run too, so its row in the UI shows them."""
        from mlflow.entities import Metric

        if not self.parent_run_id:
            return
        now = int(time.time() * 1000)
        items = [Metric(k, float(v), now, 0) for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)]
        if items:
            self._batch(self.parent_run_id, metrics=items)

    def log_parent_artifact(self, path: str | os.PathLike, artifact_path: str | None = None) -> None:
        if self.parent_run_id and self.log_artifacts and Path(path).is_file():
            self.client.log_artifact(self.parent_run_id, str(path), artifact_path)

    def log_datasets(self, datasets: Mapping[str, tuple[Any, str]], context: str) -> None:
        """Each ``name -> (features, source path)`` as an MLflow dataset input of this run
        (name, digest, source), with ``context`` (training, evaluation) as MLflow tags it."""
        import mlflow.data
        from mlflow.entities import DatasetInput, InputTag

        inputs = []
        with warnings.catch_warnings():
            # MLflow registers its local-file dataset source twice (for the URI schemes "" and
            # "file"), so every local path "can be interpreted in multiple ways:
            # LocalArtifactDatasetSource, LocalArtifactDatasetSource", once per dataset per
            # stage; both are the same source, and MLflow takes either. Only that warning is ignored.
            warnings.filterwarnings("ignore", message="The specified dataset source can be interpreted in multiple ways")
            for name, (features, source) in datasets.items():
                dataset = mlflow.data.from_numpy(features, source=str(source), name=name)
                inputs.append(DatasetInput(dataset._to_mlflow_entity(), tags=[InputTag("mlflow.data.context", context)]))
        if inputs:
            self.client.log_inputs(self.run_id, datasets=inputs)

    def log_onnx_model(self, path: str | os.PathLike, input_example, name: str = "inference_model") -> str | None:
        """The ONNX file as an MLflow model (the onnx flavor, with the signature its input example
        gives and the example itself); returns its ``runs:/`` URI."""
        import mlflow
        import mlflow.onnx
        import onnx
        from mlflow.models import infer_signature

        import odt_ops

        if not self.log_artifacts:
            return None
        model = onnx.load(str(path))
        session = odt_ops.InferenceSession(model)
        outputs = session.run(None, {session.input_names()[0]: input_example})[0]
        mlflow.set_tracking_uri(tracking_uri())
        # the fluent API logs models into the active run: this run, resumed and left running
        with mlflow.start_run(run_id=self.run_id, nested=mlflow.active_run() is not None):
            # pip_requirements given: MLflow would otherwise infer them by loading the model in a
            # fresh Python process (seconds per stage) to find what the flavor's defaults already say
            info = mlflow.onnx.log_model(model, name=name, input_example=input_example,
                                         signature=infer_signature(input_example, outputs),
                                         onnx_execution_providers=["CPUExecutionProvider"],
                                         pip_requirements=mlflow.onnx.get_default_pip_requirements())
        self.client.update_run(self.run_id, status="RUNNING")  # start_run's exit marked it finished; the stage ends it
        return info.model_uri

    def register_model(self, model_uri: str, name: str, alias: str) -> str | None:
        """A new version of registered model ``name`` from ``model_uri``, given ``alias``."""
        import mlflow

        mlflow.set_tracking_uri(tracking_uri())
        version = mlflow.register_model(model_uri, name, tags={"odt.run": self.run_id})
        self.client.set_registered_model_alias(name, alias, version.version)
        return version.version

    def flush(self) -> None:
        while self._buffer:
            chunk, self._buffer = self._buffer[:BATCH], self._buffer[BATCH:]
            self._batch(self.run_id, metrics=chunk)


def _param_value(v: Any) -> str:
    text = "null" if v is None else str(v)
    return text if len(text) <= MAX_PARAM_LENGTH else text[:MAX_PARAM_LENGTH - 3] + "..."


@contextlib.contextmanager
def stage_run(stage: str, cfg, *, config_source: str | None = None) -> Iterator[NullRun]:
    """Open the MLflow run of ``stage`` (see the module docstring); yields a NullRun when
    ``cfg.tracking.enabled`` is false. The run ends FINISHED, or FAILED if the body raised."""
    if not cfg.tracking.enabled:
        yield NullRun()
        return
    from pipeline.config import to_container
    from pipeline.io import flatten

    client, experiment_id = _client_and_experiment(cfg.tracking.experiment)
    try:
        parent = _parent_run_id(client, experiment_id, cfg)
        tags = {**run_tags(stage), "mlflow.source.name": f"pipeline.{stage}", "mlflow.source.type": "LOCAL"}
        if config_source:
            tags["odt.config_source"] = config_source
        if parent:
            tags["mlflow.parentRunId"] = parent
        run = client.create_run(experiment_id, run_name=stage, tags=tags)
    except TrackingError:
        raise
    except Exception as exc:
        raise TrackingError(f"MLflow store {tracking_uri()}: cannot create the run of stage {stage!r} ({_first_line(exc)})") from None
    tracker = StageRun(client, run.info.run_id, parent, log_artifacts=cfg.tracking.log_artifacts)
    status = "FAILED"
    try:
        tracker.log_params(flatten(to_container(cfg)))
        yield tracker
        status = "FINISHED"
    except KeyboardInterrupt:
        status = "KILLED"
        raise
    finally:
        try:
            tracker.wait()
        finally:
            client.set_terminated(tracker.run_id, status)
            if parent:
                _touch_parent(client, parent, status)


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


def _client_and_experiment(name: str):
    import logging

    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")  # the network is not ours to use
    for logger in ("mlflow.store.db.utils", "alembic"):  # "Creating initial MLflow database tables..."
        logging.getLogger(logger).setLevel(logging.WARNING)
    try:
        from mlflow import MlflowClient
        from mlflow.exceptions import MlflowException
    except ImportError:
        raise TrackingError("tracking needs mlflow: pip install -e '.[pipeline]', or run with tracking=disabled") from None
    uri = tracking_uri()
    try:
        client = MlflowClient(tracking_uri=uri)
        experiment = client.get_experiment_by_name(name)
        if experiment is None:
            try:
                return client, client.create_experiment(name, artifact_location=artifact_location(uri),
                                                        tags={EXPERIMENT_KIND_TAG: EXPERIMENT_KIND})
            except MlflowException:  # created meanwhile by a parallel queued experiment
                experiment = client.get_experiment_by_name(name)
                if experiment is None:
                    raise
        if experiment.lifecycle_stage == "deleted":
            raise TrackingError(f"MLflow experiment {name!r} in {uri} is deleted; restore it or set tracking.experiment to another name")
        if EXPERIMENT_KIND_TAG not in experiment.tags:  # made by an earlier version, or by hand
            client.set_experiment_tag(experiment.experiment_id, EXPERIMENT_KIND_TAG, EXPERIMENT_KIND)
        return client, experiment.experiment_id
    except TrackingError:
        raise
    except Exception as exc:
        raise TrackingError(
            f"MLflow store {uri}: not usable ({_first_line(exc)}); fix MLFLOW_TRACKING_URI or run with tracking=disabled"
        ) from None


def _parent_run_id(client, experiment_id: str, cfg=None) -> str | None:
    given = os.environ.get(PARENT_ENV)
    if given:
        try:
            run = client.get_run(given)
        except Exception:
            raise TrackingError(f"{PARENT_ENV}={given}: no such run in {tracking_uri()}; unset it or pass an existing run id") from None
        if run.info.lifecycle_stage == "deleted":
            raise TrackingError(f"{PARENT_ENV}={given}: that run is deleted; unset it or pass another run id")
        return given
    key = dvc_invocation_key()
    if key is None:
        return None
    found = client.search_runs([experiment_id], filter_string=f"tags.`{PIPELINE_KEY_TAG}` = '{key}'", max_results=1)
    if found:
        return found[0].info.run_id
    tags = {PIPELINE_KEY_TAG: key, "odt.stage": "pipeline", "mlflow.source.type": "LOCAL"}
    tags.update({k: v for k, v in run_tags("pipeline").items() if k not in ("odt.stage", "dvc.stage")})
    parent = client.create_run(experiment_id, run_name=pipeline_run_name(tags), tags=tags)
    if cfg is not None:  # the pipeline's configuration, as every stage sees it
        from pipeline.config import to_container
        from pipeline.io import flatten

        parent_run = StageRun(client, parent.info.run_id, None)
        parent_run.log_params(flatten(to_container(cfg)))
        parent_run.wait()
    client.set_terminated(parent.info.run_id, "FINISHED")
    return parent.info.run_id


def _touch_parent(client, parent: str, status: str) -> None:
    """Keep the pipeline run's end time and status current (FAILED sticks)."""
    try:
        current = client.get_run(parent).info.status
        client.set_terminated(parent, "FAILED" if "FAILED" in (current, status) else "FINISHED")
    except Exception:
        pass  # a parent we cannot update (another user's run, a read-only store) is not fatal


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


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
