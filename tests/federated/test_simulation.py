"""Flower's simulation engine (run_simulation, Ray backend, one CPU and one BLAS thread per client)
through the federate stage at test size: 5 users of the digits demo, 3 rounds. The global model's
accuracy rises, the same seed gives the same bits, and the stage writes what DVC and MLflow take."""
from __future__ import annotations

import csv
import io
import json
import os
import sys

import numpy as np
import pytest

pytest.importorskip("flwr")
pytest.importorskip("ray")
pytest.importorskip("hydra")

from pipeline import config, convert, federate, generate, prepare, pretrain, users
from pipeline.paths import Paths
from tests.pipeline.conftest import REPO

TINY = ["tracking=disabled", "data.user_samples=100", "data.user_train_per_class=3",
        "federated.clients=5", "federated.rounds=3", "federated.fraction_train=1.0",
        "federated.population.train_per_client=20", "federated.population.holdout_per_client=20", "federated.finetune_epochs=2"]


@pytest.fixture(scope="module")
def generated(tmp_path_factory):
    cfg = config.load(TINY, root=REPO)
    paths = Paths(tmp_path_factory.mktemp("fed_pipeline"))
    for stage in (prepare, convert, pretrain, generate):
        stage.run(cfg, paths)
    return cfg, paths


def test_population_is_made_on_demand_deterministic_and_disjoint_from_the_clouds(generated):
    cfg, paths = generated
    from pipeline import inputs

    train, test = inputs.load_split(paths, "global_train"), inputs.load_split(paths, "global_test")
    pool = users.client_pool(train, test)
    cloud = {r.tobytes() for r in np.concatenate([train.x, test.x])}
    assert not any(r.tobytes() in cloud for r in pool[0])
    assert len(pool[0]) >= 80
    pop = users.Population.from_config(cfg, pool)
    a, b = pop.user(3), users.Population.from_config(cfg, pool).user(3)
    assert all(np.array_equal(u, v) for u, v in zip(a, b))
    x, y, xh, yh = a
    assert len(y) + len(yh) <= 40
    assert len(y) >= 15
    assert x.shape[1:] == (1, 8, 8)
    styles = [pop.style(c) for c in range(5)]
    assert len({round(s["slant_deg"], 3) for s in styles}) == 5
    assert max(max(s["class_mix"]) for s in styles) > 0.2  # label skew


_FORKS_DURING_EVALUATION: list[int] = []
_EVALUATING: list[bool] = []


def _count_fork() -> None:
    if _EVALUATING:
        _FORKS_DURING_EVALUATION.append(os.getpid())


os.register_at_fork(before=_count_fork)  # process-wide and permanent: it only counts while a test evaluates


@pytest.mark.slow
def test_simulated_federation_learns_and_is_bit_identical(generated, tmp_path, monkeypatch):
    cfg, paths = generated
    import ray

    from odt_ops.federated import task

    ray_was_up = []
    central_evaluation = task.central_evaluation

    def watched_evaluation(*args, **kwargs):
        evaluate = central_evaluation(*args, **kwargs)

        def run(server_round, params):
            # the server computes only once Ray is up: a fork (Ray starting its processes) during
            # a threaded OpenBLAS product in this thread would hang it for good
            ray_was_up.append(ray.is_initialized())
            _EVALUATING.append(True)
            try:
                return evaluate(server_round, params)
            finally:
                _EVALUATING.clear()

        return run

    monkeypatch.setattr(task, "central_evaluation", watched_evaluation)
    runs = []
    for i in range(2):
        out = paths.redirect("federate", tmp_path / f"run{i}")
        out.out("federate").mkdir(parents=True)
        metrics = federate.run(cfg, out)
        runs.append((out.out("federate"), metrics))
    (a, ma), (b, mb) = runs
    assert ray_was_up and all(ray_was_up), ray_was_up
    assert not _FORKS_DURING_EVALUATION
    rows = list(csv.DictReader((a / "rounds.csv").read_text().splitlines()))
    assert [int(r["round"]) for r in rows] == [0, 1, 2, 3]
    assert all(int(r["participants"]) == 5 for r in rows[1:])
    holdout = [float(r["client_accuracy"]) for r in rows]
    test_acc = [float(r["global_test_accuracy"]) for r in rows]
    # the global model reads the users' handwriting better each round (the crowd's test set pays a little: forgetting)
    assert holdout[0] < holdout[1] < holdout[3], (holdout, test_acc)
    # the same seed: the same global model, byte for byte, and the same per-round record
    assert (a / "checkpoint").read_bytes() == (b / "checkpoint").read_bytes()
    assert (a / "rounds.csv").read_text() == (b / "rounds.csv").read_text()
    assert (a / "metrics.json").read_text() == (b / "metrics.json").read_text()
    # outputs: an artifacts-compatible checkpoint, an inference model, the last round's diffs
    from odt_ops.api import CheckpointState, Module
    from odt_ops.federated import load_encoded

    gen = paths.out("generate")
    Module(gen / "training_model.onnx", CheckpointState.load_checkpoint(a / "checkpoint"), gen / "eval_model.onnx")
    import odt_ops

    assert odt_ops.InferenceSession(a / "inference.onnx").run(None, {"input": np.zeros((2, 1, 8, 8), np.float32)})[0].shape == (2, 10)
    diffs = sorted((a / "diffs").iterdir())
    assert len(diffs) == 5
    assert load_encoded(diffs[0]).encoding == "float32"
    m = json.loads((a / "metrics.json").read_text())
    assert set(m["holdout"]) == {"base", "local_only", "fedavg", "fedavg_finetune"}
    assert m["bytes"]["payload_up_per_client_round"] == 650 * 4  # the head's 650 float32 values
    assert ma["rounds_kept_global"] == 0
    assert ma["dropped"] == 0


def test_conf_federated_is_federation_settings():
    """One schema: conf/federated's keys are FederationSettings' fields (less the top-level seed)
    plus the stage's own, and the composed group gives the settings the stage and the app run."""
    from dataclasses import fields

    from odt_ops.federated.settings import DPSettings, FederationSettings, SecAggSettings

    raw = config.compose([], root=REPO).federated
    own = {"finetune_epochs", "population", "num_cpus"}
    assert set(raw) - own == {f.name for f in fields(FederationSettings)} - {"seed"}
    assert set(raw.dp) == {f.name for f in fields(DPSettings)}
    assert set(raw.secagg) == {f.name for f in fields(SecAggSettings)}
    cfg = config.load(["federated=fedprox", "federated.rounds=4", "seed=7"], root=REPO)
    s = cfg.federated.settings(cfg.seed)
    assert (s.strategy, s.mu, s.rounds, s.seed, s.lr) == ("fedprox", 0.1, 4, 7, float(raw.lr))


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_metrics_named_after_the_strategy_and_a_line_per_round_on_a_terminal(generated, tmp_path, monkeypatch):
    """Under FedProx the comparison's metrics are holdout.fedprox*, and a terminal shows each
    round as it ends. Flower's loop and strategies run on an in-process grid here (no Ray):
    what is checked is the stage's own output."""
    from odt_ops.federated import simulation
    from odt_ops.federated.flower import client_app, run_federation
    from tests.federated.helpers import NodeGrid

    def in_process(artifacts, data, settings, *, evaluate_fn=None, progress=None, **_):
        return run_federation(NodeGrid(client_app(artifacts, data), settings.clients), artifacts, settings, evaluate_fn=evaluate_fn,
                              progress=progress)

    _, paths = generated
    cfg = config.load([*TINY, "federated=fedprox", "federated.rounds=2"], root=REPO)
    monkeypatch.setattr(simulation, "simulate", in_process)
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    out = paths.redirect("federate", tmp_path / "fedprox")
    out.out("federate").mkdir(parents=True)
    federate.run(cfg, out)
    m = json.loads((out.out("federate") / "metrics.json").read_text())
    assert set(m["holdout"]) == {"base", "local_only", "fedprox", "fedprox_finetune"}
    lines = [line for line in terminal.getvalue().splitlines() if line.startswith("federate: round")]
    assert [line.split(":")[1].strip() for line in lines] == ["round 1/2", "round 2/2"]
    assert all("5/5 clients succeeded" in line and "clients' accuracy" in line and "B up" in line for line in lines), lines
