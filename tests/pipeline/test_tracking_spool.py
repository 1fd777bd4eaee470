"""The fast path: a stage that spools its tracking records (as every stage under DVC does)
and the logging process that writes them give MLflow what the stage did, read back through
MlflowClient: its params are params.yaml's, its metrics its metrics file's, its loss curve
curve.csv's rows, its artifacts its output files, its datasets MLflow's own digests of the
splits it read, its model an onnx-flavored MLflow model; and all of it the same as the same
stage writing MLflow in-process (the direct path). The stage process never imports mlflow."""
from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from pipeline import config, mlflow_logger
from pipeline.io import flatten
from pipeline.mlflow_writer import SPOOL_TAG
from tests.pipeline.conftest import REPO, TINY_RUN

mlflow = pytest.importorskip("mlflow")

UPSTREAM = ("prepare", "convert", "pretrain", "generate")  # run untracked, once
STAGES = ("train", "evaluate", "export")  # every kind of record: step metrics, plots, datasets, folders, a model, the parent's


def _run_stage(project: Path, stage: str, mode: str, parent: str) -> None:
    env = {**os.environ, "ODT_TRACKING_MODE": mode, "ODT_PARENT_RUN_ID": parent, "PYTHONPATH": str(REPO)}
    code = (f"import sys, importlib; m = importlib.import_module('pipeline.{stage}'); rc = m.main(sys.argv[1:]);"
            "print('MLFLOW-IMPORTED' if 'mlflow' in sys.modules else 'no-mlflow'); sys.exit(rc)")
    out = subprocess.run([sys.executable, "-c", code, "tracking=mlflow", *TINY_RUN], cwd=project, env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    if mode == "spool":
        assert "no-mlflow" in out.stdout, f"{stage}: the spooling stage imported mlflow"


def _artifacts(client, run_id: str, path: str = "") -> set[str]:
    found = set()
    for f in client.list_artifacts(run_id, path):
        found |= _artifacts(client, run_id, f.path) if f.is_dir else {f.path}
    return found


def _record(client, run) -> dict:
    """Everything MLflow holds about a run that does not name the run itself."""
    run_id = run.info.run_id
    history = {k: sorted((m.step, m.value) for m in client.get_metric_history(run_id, k)) for k in run.data.metrics}
    datasets = sorted((i.dataset.name, i.dataset.digest, i.dataset.source, i.dataset.schema, i.dataset.profile,
                       tuple(sorted((t.key, t.value) for t in i.tags))) for i in run.inputs.dataset_inputs)
    models = client.search_logged_models([run.info.experiment_id], filter_string=f"source_run_id = '{run_id}'")
    flavors = [sorted(yaml.safe_load((Path(mlflow.artifacts.download_artifacts(m.artifact_location)) / "MLmodel").read_text())
                      ["flavors"]) for m in models]
    return {"name": run.info.run_name, "status": run.info.status, "params": run.data.params, "metrics": run.data.metrics,
            "history": history, "tags": run.data.tags, "artifacts": _artifacts(client, run_id), "datasets": datasets,
            "models": [m.name for m in models], "flavors": flavors}


def test_spooled_runs_hold_what_the_stages_did_and_equal_the_direct_path(project, mlflow_store):
    client = mlflow.MlflowClient(tracking_uri=mlflow_store)
    experiment_id = client.create_experiment("odt", artifact_location=(project / "mlartifacts").as_uri())
    (project / "params.yaml").write_text(config.compose_yaml(root=project))
    subprocess.run(["git", "init", "-q"], cwd=project, check=True)  # stage runs are tagged with the commit
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@localhost", "commit", "-q", "--allow-empty", "-m", "x"],
                   cwd=project, check=True)
    import importlib

    for stage in UPSTREAM:
        assert importlib.import_module(f"pipeline.{stage}").main(["tracking=disabled", *TINY_RUN]) == 0, stage
    parents = {mode: client.create_run(experiment_id, run_name=f"pipeline-{mode}").info.run_id for mode in ("direct", "spool")}
    records, outputs = {}, {}
    for mode in ("direct", "spool"):
        for stage in STAGES:
            _run_stage(project, stage, mode, parents[mode])
        if mode == "spool":
            assert mlflow_logger.wait(project / mlflow_logger.SPOOL, timeout=300) == []
            assert list(mlflow_logger.pending(project / mlflow_logger.SPOOL)) == []
        runs = client.search_runs([experiment_id], filter_string=f"tags.`mlflow.parentRunId` = '{parents[mode]}'")
        records[mode] = {r.info.run_name: _record(client, r) for r in runs}
        outputs[mode] = {s: json.loads((project / "data" / s / "metrics.json").read_text())
                         for s in STAGES if (project / "data" / s / "metrics.json").is_file()}
    spooled, direct = records["spool"], records["direct"]
    assert sorted(spooled) == sorted(STAGES)
    assert outputs["spool"] == outputs["direct"]  # the same work both times: the records may be compared

    for stage in STAGES:
        s, d = spooled[stage], direct[stage]
        assert s["status"] == "FINISHED", stage
        # params: the configuration the stage ran (params.yaml plus the overrides)
        assert s["params"]["optimizer.lr"] == str(yaml.safe_load((project / "params.yaml").read_text())["optimizer"]["lr"]), stage
        assert {k: s["params"][k] for k in ("data.user_samples", "train.epochs", "tracking.enabled")} == \
            {"data.user_samples": "100", "train.epochs": "3", "tracking.enabled": "True"}, stage
        # metrics: every number of the stage's metrics file (rounded there; the console's timings are extra;
        # evaluate's example counts are not metrics)
        on_disk = {k: v for k, v in flatten(outputs["spool"].get(stage, {})).items() if not k.endswith(".n")}
        for key, value in on_disk.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                assert s["metrics"][key] == pytest.approx(value, rel=1e-3), (stage, key)
        # artifacts: the stage's output files, under the stage's name
        files = {p.relative_to(project / "data").as_posix() for p in (project / "data" / stage).rglob("*")
                 if p.is_file() and not p.name.startswith(".")}
        assert files <= s["artifacts"], (stage, files - s["artifacts"])
        # the same as the direct path wrote, except what is the run's own (ids, times of the timing metrics)
        for field in ("params", "artifacts", "datasets", "models", "flavors"):
            assert s[field] == d[field], (stage, field)
        assert set(s["metrics"]) == set(d["metrics"]), stage
        timing = {"seconds", "steps_per_second", "seconds_per_round"}
        for key in set(s["metrics"]) - timing:
            assert s["metrics"][key] == d["metrics"][key], (stage, key)
        skip = {"mlflow.parentRunId", "mlflow.runName", SPOOL_TAG}  # the run's own: its parent, name and spooled file
        assert {k: v for k, v in s["tags"].items() if k not in skip} == {k: v for k, v in d["tags"].items() if k not in skip}, stage

    # the loss curve per step is curve.csv's
    with open(project / "data/train/curve.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    got = spooled["train"]["history"]["loss"]
    assert [step for step, _ in got] == [int(r["step"]) for r in rows]
    assert [v for _, v in got] == pytest.approx([float(r["loss"]) for r in rows], rel=1e-5)
    assert {"plots/loss_curve.png"} <= spooled["train"]["artifacts"] or not _plots()
    # the Dataset column: MLflow's own digest of each split's features
    for name, digest, source, *_ in spooled["evaluate"]["datasets"]:
        x = np.load(project / json.loads(source)["uri"])["x"]
        assert digest == mlflow.data.from_numpy(x, name=name).digest, name
    assert {d[0] for d in spooled["evaluate"]["datasets"]} == {"user_holdout", "global_test"}
    # the Models column: the exported model, onnx flavor
    assert spooled["export"]["models"] == ["inference_model"]
    assert "onnx" in spooled["export"]["flavors"][0]


def _plots() -> bool:
    from pipeline import plots

    return plots.available()


def test_a_run_mlflow_refuses_is_named_by_wait_and_kept(tmp_path, mlflow_store, capsys):
    """A spooled run whose parent does not exist: --wait exits 1 with one line naming the run
    and MLflow's reason; the run stays in failed/ and the spool is otherwise drained."""
    from pipeline.mlflow_writer import dumps

    spool = tmp_path / mlflow_logger.SPOOL
    spool.mkdir()
    start = {"op": "start", "uri": mlflow_store, "experiment": "odt", "run_name": "train", "tags": {}, "start_time": 1,
             "log_artifacts": True, "parent": {"id": "0123456789abcdef0123456789abcdef"}}
    (spool / "1-bad.jsonl").write_text(dumps([start, {"op": "end", "status": "FINISHED", "end_time": 2}]))
    good = {**start, "parent": None, "run_name": "evaluate"}
    (spool / "2-good.jsonl").write_text(dumps([good, {"op": "params", "params": {"seed": "0"}},
                                               {"op": "end", "status": "FINISHED", "end_time": 3}]))
    failed = mlflow_logger.wait(spool)
    assert len(failed) == 1
    assert failed[0].startswith(".mlflow-spool/failed/1-bad.jsonl: TrackingError: ODT_PARENT_RUN_ID=0123456789abcdef"), failed
    assert (spool / "failed" / "1-bad.jsonl").is_file()
    assert mlflow_logger.pending(spool) == []
    client = mlflow.MlflowClient(tracking_uri=mlflow_store)
    (run,) = client.search_runs([client.get_experiment_by_name("odt").experiment_id])
    assert (run.info.run_name, run.data.params, run.info.start_time, run.info.end_time) == ("evaluate", {"seed": "0"}, 1, 3)



def test_a_run_whose_logger_was_killed_while_writing_it_appears_once(tmp_path, mlflow_store):
    """A logging process killed between creating a run and removing its spooled file (here: the
    run created, the file left) leaves a partial run in MLflow; the next logger writes the file
    again and MLflow then holds that run once, finished, with all its records."""
    from pipeline.mlflow_writer import Writer, dumps, loads

    spool = tmp_path / mlflow_logger.SPOOL
    spool.mkdir()
    start = {"op": "start", "uri": mlflow_store, "experiment": "odt", "run_name": "train", "tags": {}, "start_time": 1,
             "log_artifacts": True, "parent": None}
    path = spool / "1-train.jsonl"
    path.write_text(dumps([start, {"op": "params", "params": {"seed": "0"}}, {"op": "end", "status": "FINISHED", "end_time": 3}]))
    Writer().start(loads(path.read_text())[0], spool_id=path.stem)  # the killed logger got this far
    assert mlflow_logger.wait(spool) == []
    client = mlflow.MlflowClient(tracking_uri=mlflow_store)
    (run,) = client.search_runs([client.get_experiment_by_name("odt").experiment_id])  # active runs only
    assert (run.info.run_name, run.info.status, run.data.params, run.data.tags[SPOOL_TAG]) == ("train", "FINISHED", {"seed": "0"}, "1-train")

def test_under_dvc_one_logging_process_writes_the_stages_runs(tmp_path):
    """`dvc repro convert` (prepare and convert) in a fresh clone with tracking on: neither stage
    imports mlflow; one logging process writes both runs, nested under the command's pipeline
    run (named after the commit), and --wait returns once they are in MLflow."""
    pytest.importorskip("dvc")
    from tests.pipeline.conftest import dvc_env, project_copy

    repo = project_copy(tmp_path / "clone", "data:\n  user_samples: 100\n  user_train_per_class: 3\n")
    env = dvc_env(tmp_path)
    # a tripwire like dvc_env's torch: each process importing mlflow records its script, then gets the real one
    trap = Path(env["PYTHONPATH"]) / "mlflow"
    trap.mkdir()
    (trap / "__init__.py").write_text(
        "import importlib, os, sys\n"
        f"open({str(tmp_path / 'mlflow-imported')!r}, 'a').write(os.path.basename(sys.argv[0]) + '\\n')\n"
        f"sys.path[:] = [p for p in sys.path if os.path.abspath(p) != {str(trap.parent)!r}]\n"
        "del sys.modules['mlflow']\n"
        "sys.modules['mlflow'] = importlib.import_module('mlflow')\n")
    out = subprocess.run([sys.executable, "-m", "dvc", "repro", "convert"], cwd=repo, env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    imported = set((tmp_path / "mlflow-imported").read_text().split())
    assert imported <= {"mlflow_logger.py"}, imported  # the logging process only: no stage imported mlflow
    waited = subprocess.run([sys.executable, "-m", "pipeline.mlflow_logger", "--wait", "--timeout", "300"], cwd=repo,
                            env={**env, "PYTHONPATH": ""}, capture_output=True, text=True, timeout=600)
    assert waited.returncode == 0, waited.stderr
    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{repo / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("odt").experiment_id])
    by_name = {r.info.run_name: r for r in runs}
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True, check=True).stdout.strip()
    pipeline_run = by_name[f"repro@{commit[:8]}"]
    assert set(by_name) == {"prepare", "convert", pipeline_run.info.run_name}
    for stage in ("prepare", "convert"):
        assert by_name[stage].data.tags["mlflow.parentRunId"] == pipeline_run.info.run_id
        assert by_name[stage].info.status == "FINISHED"
        assert by_name[stage].data.tags["dvc.stage"] == stage
    assert by_name["prepare"].data.metrics["n_user_train"] == 30
    loggers = [line for line in (repo / ".mlflow-spool" / "logger.log").read_text().splitlines() if line.startswith("logger ")]
    assert len(loggers) == 1, loggers
    assert " 2 run(s) written" in loggers[0], loggers
    assert imported == {"mlflow_logger.py"}


def test_files_of_a_killed_stage_go_after_a_day(tmp_path):
    spool = tmp_path / mlflow_logger.SPOOL
    for name in ("1-killed", "2-running", "3-done"):
        (spool / f"{name}.files" / "001").mkdir(parents=True)
    (spool / "3-done.jsonl").write_text("")
    day_ago = os.stat(spool).st_mtime - mlflow_logger.STALE - 60
    for name in ("1-killed", "3-done"):
        os.utime(spool / f"{name}.files", (day_ago, day_ago))
    assert mlflow_logger.remove_stale(spool) == [spool / "1-killed.files"]
    assert sorted(p.name for p in spool.glob("*.files")) == ["2-running.files", "3-done.files"]
