"""What a stage's tracking records become in MLflow: the one place that calls MLflow's API.

A stage never calls MLflow itself. Its tracker (pipeline.tracking) turns every call into a
record, a JSON-able dict; ``Writer`` turns records into MLflow calls. Under DVC the records
go through the spool to one logging process per DVC command (pipeline.mlflow_logger), so
``import mlflow`` (2 s of CPU: it imports pandas and its GenAI modules) is paid once, not
once per stage; a stage run by hand, and the retraining job, write them in-process.

The records of one run, in order (times in ms since the epoch, as MLflow keeps them):

- ``start``: the store's URI, the experiment, run name, tags, start time, whether artifacts
  are logged, and the parent: ``{"id": run id}`` (given), ``{"key": ..., "name": ...,
  "tags": ..., "params": ...}`` (the pipeline run of one DVC command: found by its key tag,
  or created) or null;
- ``params``, ``tags``, ``metrics`` (``[key, value, timestamp, step]`` rows; ``"run":
  "parent"`` puts them on the pipeline run), ``artifact`` (a file or folder, ``run`` as
  for metrics), ``datasets`` (``[name, npz file, source shown]`` rows read as MLflow numpy
  datasets, with a context), ``plot`` (a PNG drawn by pipeline.plots from the stage's
  files), ``onnx_model`` (an ONNX file and an .npy input example, logged in the onnx flavor);
- ``end``: the status and end time.

Params, tags and metrics go in ``log_batch`` calls (MLflow's limits: 100 params, 1000
metrics, 1000 entities a call), so a run is a few SQLite transactions.
"""
from __future__ import annotations

import json
import logging
import os
import tempfile
import warnings
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from pipeline.errors import TrackingError

BATCH_METRICS, BATCH_PARAMS, BATCH_ENTITIES = 1000, 100, 1000  # MLflow's log_batch limits
# MLflow 3 opens an experiment on its GenAI overview unless its kind says model training
EXPERIMENT_KIND_TAG, EXPERIMENT_KIND = "mlflow.experimentKind", "custom_model_development"
PIPELINE_KEY_TAG = "odt.pipeline_key"  # the pipeline run of one DVC command, found by this tag
PARENT_ENV = "ODT_PARENT_RUN_ID"  # the run a stage nests under when given (not MLFLOW_RUN_ID, which resumes a run)
SPOOL_TAG = "odt.spool_run"  # the spooled file a run was written from


def artifact_location(uri: str) -> str | None:
    """``mlartifacts/`` beside a SQLite store; None (the server decides) otherwise."""
    if uri.startswith("sqlite:///"):
        db = Path(uri.removeprefix("sqlite:///"))
        return (db.resolve().parent / "mlartifacts").as_uri()
    return None


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


class Writer:
    """Applies runs' records to MLflow; keeps one client per store and the pipeline runs it
    found or made, so one logging process serves every stage of a DVC command."""

    def __init__(self) -> None:
        os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")  # the network is not ours to use
        for logger in ("mlflow.store.db.utils", "alembic"):  # "Creating initial MLflow database tables..."
            logging.getLogger(logger).setLevel(logging.WARNING)
        try:
            import mlflow  # noqa: F401
        except ImportError:
            raise TrackingError("tracking needs mlflow: pip install -e '.[pipeline]', or run with tracking=disabled") from None
        self._clients: dict[str, Any] = {}
        self._experiments: dict[tuple[str, str], str] = {}
        self._parents: dict[tuple[str, str], str] = {}

    # ------------------------------------------------------------------ a whole run
    def write_run(self, records: list[dict], spool_id: str | None = None) -> str:
        """Every record of one run (``start`` first, ``end`` last); returns the run id.
        ``spool_id`` names the spooled file the records came from (see ``start``)."""
        start, body, end = records[0], records[1:-1], records[-1]
        if start["op"] != "start" or end["op"] != "end":
            raise TrackingError("a spooled run must begin with 'start' and end with 'end'")
        run_id, parent = self.start(start, spool_id)
        try:
            self.write(start, run_id, parent, body)
        finally:
            self.end(start, run_id, parent, end)
        return run_id

    def start(self, start: dict, spool_id: str | None = None) -> tuple[str, str | None]:
        """Create the run (and find or create its parent); returns (run id, parent id).

        A run from the spool carries its file's name (tag SPOOL_TAG): a logging process killed
        while writing it leaves the file in the spool and a partial run in MLflow, and the next
        one, writing the file again, deletes that partial run first, so the run appears once."""
        uri = start["uri"]
        client = self.client(uri)
        try:
            experiment_id = self.experiment(uri, start["experiment"])
            parent = self._parent(uri, experiment_id, start.get("parent"), start["start_time"])
            tags = dict(start["tags"])
            if parent:
                tags["mlflow.parentRunId"] = parent
            if spool_id:
                tags[SPOOL_TAG] = spool_id
                for partial in client.search_runs([experiment_id], filter_string=f"tags.`{SPOOL_TAG}` = '{spool_id}'"):
                    client.delete_run(partial.info.run_id)
            run = client.create_run(experiment_id, start_time=start["start_time"], run_name=start["run_name"], tags=tags)
        except TrackingError:
            raise
        except Exception as exc:
            raise TrackingError(f"MLflow store {uri}: cannot create the run of stage {start['run_name']!r} ({first_line(exc)})") from None
        return run.info.run_id, parent

    def write(self, start: dict, run_id: str, parent: str | None, records: Iterable[dict]) -> None:
        """The records between ``start`` and ``end``: params, tags and metrics batched."""
        from mlflow.entities import Metric, Param, RunTag

        client = self.client(start["uri"])
        batches: dict[str, dict[str, list]] = {}  # run id -> its params, tags and metrics
        later = []
        for rec in records:
            target = parent if rec.get("run") == "parent" else run_id
            if target is None:  # the pipeline run's share, with no pipeline run (a stage run by hand)
                continue
            batch = batches.setdefault(target, {"params": [], "tags": [], "metrics": []})
            op = rec["op"]
            if op == "params":
                batch["params"] += [Param(k, v) for k, v in rec["params"].items()]
            elif op == "tags":
                batch["tags"] += [RunTag(k, v) for k, v in rec["tags"].items()]
            elif op == "metrics":
                batch["metrics"] += [Metric(k, float(v), int(ts), int(step)) for k, v, ts, step in rec["metrics"]]
            else:
                later.append((target, rec))
        for target, b in batches.items():
            self._log_batch(client, target, **b)
        for target, rec in later:
            op = rec["op"]
            if op == "artifact" and start["log_artifacts"]:
                self.log_artifact(client, target, rec["path"], rec.get("artifact_path"))
            elif op == "datasets":
                self.log_datasets(client, target, rec["items"], rec["context"])
            elif op == "plot" and start["log_artifacts"]:
                self.log_plot(client, target, rec)
            elif op == "onnx_model" and start["log_artifacts"]:
                self.log_onnx_model(start["uri"], target, rec["path"], rec["example"], rec["name"])

    def end(self, start: dict, run_id: str, parent: str | None, end: dict) -> None:
        client = self.client(start["uri"])
        client.set_terminated(run_id, end["status"], end_time=end["end_time"])
        if parent:
            try:  # the pipeline run's end time and status current (FAILED sticks)
                current = client.get_run(parent).info.status
                client.set_terminated(parent, "FAILED" if "FAILED" in (current, end["status"]) else "FINISHED",
                                      end_time=end["end_time"])
            except Exception:
                pass  # a parent we cannot update (another user's run, a read-only store) is not fatal

    # ------------------------------------------------------------------ the store
    def client(self, uri: str):
        if uri not in self._clients:
            from mlflow import MlflowClient

            try:
                self._clients[uri] = MlflowClient(tracking_uri=uri)
            except Exception as exc:
                raise TrackingError(f"MLflow store {uri}: not usable ({first_line(exc)}); fix MLFLOW_TRACKING_URI or run with "
                                    "tracking=disabled") from None
        return self._clients[uri]

    def experiment(self, uri: str, name: str) -> str:
        if (uri, name) in self._experiments:
            return self._experiments[uri, name]
        from mlflow.exceptions import MlflowException

        client = self.client(uri)
        try:
            experiment = client.get_experiment_by_name(name)
            if experiment is None:
                try:
                    experiment_id = client.create_experiment(name, artifact_location=artifact_location(uri),
                                                             tags={EXPERIMENT_KIND_TAG: EXPERIMENT_KIND})
                    self._experiments[uri, name] = experiment_id
                    return experiment_id
                except MlflowException:  # created meanwhile by a parallel queued experiment
                    experiment = client.get_experiment_by_name(name)
                    if experiment is None:
                        raise
            if experiment.lifecycle_stage == "deleted":
                raise TrackingError(f"MLflow experiment {name!r} in {uri} is deleted; restore it or set tracking.experiment to another name")
            if EXPERIMENT_KIND_TAG not in experiment.tags:  # made by an earlier version, or by hand
                client.set_experiment_tag(experiment.experiment_id, EXPERIMENT_KIND_TAG, EXPERIMENT_KIND)
        except TrackingError:
            raise
        except Exception as exc:
            raise TrackingError(f"MLflow store {uri}: not usable ({first_line(exc)}); fix MLFLOW_TRACKING_URI or run with "
                                "tracking=disabled") from None
        self._experiments[uri, name] = experiment.experiment_id
        return experiment.experiment_id

    def _parent(self, uri: str, experiment_id: str, spec: Mapping | None, start_time: int) -> str | None:
        """The given run, or the pipeline run of the DVC command ``spec["key"]`` names."""
        from mlflow.entities import Param

        if not spec:
            return None
        client = self.client(uri)
        if "id" in spec:
            given = spec["id"]
            try:
                run = client.get_run(given)
            except Exception:
                raise TrackingError(f"{PARENT_ENV}={given}: no such run in {uri}; unset it or pass an existing run id") from None
            if run.info.lifecycle_stage == "deleted":
                raise TrackingError(f"{PARENT_ENV}={given}: that run is deleted; unset it or pass another run id")
            return given
        key = spec["key"]
        if (uri, key) in self._parents:
            return self._parents[uri, key]
        found = client.search_runs([experiment_id], filter_string=f"tags.`{PIPELINE_KEY_TAG}` = '{key}'", max_results=1)
        if found:
            parent = found[0].info.run_id
        else:
            parent = client.create_run(experiment_id, start_time=start_time, run_name=spec["name"],
                                       tags={PIPELINE_KEY_TAG: key, **spec["tags"]}).info.run_id
            self._log_batch(client, parent, params=[Param(k, v) for k, v in spec.get("params", {}).items()])
            client.set_terminated(parent, "FINISHED", end_time=start_time)
        self._parents[uri, key] = parent
        return parent

    @staticmethod
    def _log_batch(client, run_id: str, params=(), tags=(), metrics=()) -> None:
        """As few ``log_batch`` calls as MLflow's limits allow."""
        params, tags, metrics = list(params), list(tags), list(metrics)
        while params or tags or metrics:
            p, params = params[:BATCH_PARAMS], params[BATCH_PARAMS:]
            room = BATCH_ENTITIES - len(p)
            t, tags = tags[:room], tags[room:]
            m, metrics = metrics[:min(BATCH_METRICS, room - len(t))], metrics[min(BATCH_METRICS, room - len(t)):]
            client.log_batch(run_id, metrics=m, params=p, tags=t)

    # ------------------------------------------------------------------ files, datasets, models
    @staticmethod
    def log_artifact(client, run_id: str, path: str, artifact_path: str | None) -> None:
        p = Path(path)
        if p.is_dir():  # as a folder of that name, like a file keeps its name
            name = Path(artifact_path or "") / p.name if artifact_path else p.name
            client.log_artifacts(run_id, str(p), str(name))
        elif p.is_file():
            client.log_artifact(run_id, str(p), artifact_path)

    @staticmethod
    def log_datasets(client, run_id: str, items: list, context: str) -> None:
        """``[name, npz file, source]`` rows as MLflow dataset inputs of the run (name, digest
        of the features ``x``, source), with ``context`` (training, evaluation)."""
        import mlflow.data
        from mlflow.entities import DatasetInput, InputTag

        from pipeline.io import load_npz

        inputs = []
        with warnings.catch_warnings():
            # MLflow registers its local-file dataset source twice (for the URI schemes "" and
            # "file"), so every local path "can be interpreted in multiple ways:
            # LocalArtifactDatasetSource, LocalArtifactDatasetSource"; both are the same source,
            # and MLflow takes either. Only that warning is ignored.
            warnings.filterwarnings("ignore", message="The specified dataset source can be interpreted in multiple ways")
            for name, npz, source in items:
                features = load_npz(npz, ("x",), what="prepare output")["x"]
                dataset = mlflow.data.from_numpy(features, source=str(source), name=name)
                inputs.append(DatasetInput(dataset._to_mlflow_entity(), tags=[InputTag("mlflow.data.context", context)]))
        if inputs:
            client.log_inputs(run_id, datasets=inputs)

    @staticmethod
    def log_plot(client, run_id: str, rec: dict) -> None:
        from pipeline import plots

        if not plots.available():
            return
        with tempfile.TemporaryDirectory(prefix="odt-plots-") as tmp:
            png = plots.draw(rec["kind"], Path(tmp) / rec["name"], rec["spec"])
            client.log_artifact(run_id, str(png), rec.get("artifact_path"))

    def log_onnx_model(self, uri: str, run_id: str, path: str, example: str, name: str) -> str:
        """The ONNX file as an MLflow model (the onnx flavor, with the signature its input
        example gives and the example itself); returns its ``runs:/`` URI."""
        import mlflow
        import mlflow.onnx
        import numpy as np
        import onnx
        from mlflow.models import infer_signature

        import odt_ops

        input_example = np.load(example, allow_pickle=False)
        model = onnx.load(str(path))
        session = odt_ops.InferenceSession(model)
        outputs = session.run(None, {session.input_names()[0]: input_example})[0]
        mlflow.set_tracking_uri(uri)
        # the fluent API logs models into the active run: this run, resumed and left running
        with mlflow.start_run(run_id=run_id, nested=mlflow.active_run() is not None):
            # pip_requirements given: MLflow would otherwise infer them by loading the model in a
            # fresh Python process (seconds per stage) to find what the flavor's defaults already say
            info = mlflow.onnx.log_model(model, name=name, input_example=input_example,
                                         signature=infer_signature(input_example, outputs),
                                         onnx_execution_providers=["CPUExecutionProvider"],
                                         pip_requirements=mlflow.onnx.get_default_pip_requirements())
        self.client(uri).update_run(run_id, status="RUNNING")  # start_run's exit marked it finished; the run's end does
        return info.model_uri

    def register_model(self, uri: str, run_id: str, model_uri: str, name: str, alias: str) -> str:
        """A new version of registered model ``name`` from ``model_uri``, given ``alias``."""
        import mlflow

        mlflow.set_tracking_uri(uri)
        version = mlflow.register_model(model_uri, name, tags={"odt.run": run_id})
        self.client(uri).set_registered_model_alias(name, alias, version.version)
        return version.version


def dumps(records: list[dict]) -> str:
    """A run's records as the spool keeps them: one JSON object a line."""
    return "".join(json.dumps(r, sort_keys=True) + "\n" for r in records)


def loads(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.strip()]
