"""federate: federated learning of the generated artifacts over a population of
simulated users, on Flower: the repository's ClientApp and ServerApp (odt_ops.federated:
client_app, server_app, task) on Flower's simulation engine (Ray; the clients one CPU and
one BLAS thread each); odt_ops is every client's trainer; Flower's strategy, optionally
inside its differential-privacy wrapper or SecAgg+, aggregates. ``flwr run .`` runs the
same apps (pipeline.flower_app) with the same settings.

The users (``federated.population``, pipeline.users) are made on demand from (seed,
client id): nothing holds every client's data. What is trained is what ``generate`` made
trainable (the head by default), with its optimizer (fresh each round) at
``federated.lr``; the clients send model differences in ``federated.encoding``.

Outputs (data/federate/): ``checkpoint`` (generate's checkpoint with the global
trainable parameters: artifacts-compatible), ``inference.onnx``, ``rounds.csv`` (per
round: participants, accuracy and loss on the clients' holdouts and on the global test,
bytes up and down, for ``dvc plots``), ``rounds.json`` (the same with every dropped
client's reason), ``diffs/client_NNNN.odtdiff`` (the last round's updates as sent),
``metrics.json``: the global model and, over every user's holdout, the comparison
base / local-only (fine-tune the base on the user's own data) / the federated global
model / it plus a local fine-tune, keyed by the strategy that ran (``holdout.fedprox``).
MLflow: one run per federation with the per-round metrics (step = round) and the final
global model. On a terminal, one line per round as it ends.
"""
from __future__ import annotations

import csv
import importlib
import io
import logging
import sys
import typing
from dataclasses import asdict, dataclass, field, fields, make_dataclass
from pathlib import Path
from typing import Any

import numpy as np

from odt_ops.errors import FederationSettingsError
from odt_ops.federated.settings import DPSettings, FederationSettings, SecAggSettings
from pipeline import inference, inputs, users
from pipeline.config import MISSING, Section
from pipeline.config.schema import FieldError
from pipeline.io import atomic_write_text, nest, write_json
from pipeline.paths import Paths
from pipeline.tracking import NO_TRACKING, NullRun

ROUND_COLUMNS = ("round", "sampled", "participants", "dropped", "kept_global", "client_accuracy", "client_loss",
                 "global_test_accuracy", "global_test_loss", "bytes_up", "bytes_down", "payload_bytes_up")

# headline.json (dvc metrics show, dvc exp show): the federated global model on the global test set
HEADLINE = {"federated_accuracy": "global_test.accuracy"}


# --------------------------------------------------------------------------- the federated section
# One schema: conf/federated's keys are odt_ops.federated.settings.FederationSettings's fields
# (less ``seed``, the configuration's own), plus what only this stage uses (the population,
# the comparison's fine-tuning, the CPUs the simulation may take). The section is derived
# from the settings' dataclasses, so a new setting is a conf/ key with nothing copied.


@dataclass
class PopulationConfig(Section):
    """The simulated users (pipeline.users.Population)."""

    train_per_client: int = MISSING
    holdout_per_client: int = MISSING
    label_alpha: float = MISSING
    slant_deg: list[float] = MISSING
    strokes: list[int] = MISSING
    jitter_deg: float = MISSING

    def check(self) -> None:
        self.need(self.train_per_client >= 1, "train_per_client", "an integer >= 1")
        self.need(self.holdout_per_client >= 1, "holdout_per_client", "an integer >= 1")
        self.need(self.label_alpha > 0, "label_alpha", "a number > 0 (smaller: more skewed labels)")
        self.need(len(self.slant_deg) == 2 and self.slant_deg[0] <= self.slant_deg[1], "slant_deg", "[low, high] degrees")
        self.need(len(self.strokes) >= 1 and all(s >= 0 for s in self.strokes), "strokes", "a non-empty list of integers >= 0")


def _section(name: str, settings_cls: type, *, leave_out: tuple[str, ...] = (), nested: dict[str, type] | None = None,
             extra: list[tuple[str, type, Any]] = (), methods: dict[str, Any] | None = None) -> type:
    """A conf section (every field MISSING: conf/ holds the values) with ``settings_cls``'s fields."""
    nested = nested or {}
    hints = typing.get_type_hints(settings_cls)
    specs = [(f.name, nested.get(f.name, hints[f.name]), field(default_factory=nested[f.name]) if f.name in nested else field(default=MISSING))
             for f in fields(settings_cls) if f.name not in leave_out]
    namespace = {"__module__": __name__, "__doc__": f"conf/federated's keys for {settings_cls.__name__} (see its docstring)."}
    namespace.update(methods or {})
    return make_dataclass(name, specs + list(extra), bases=(Section,), namespace=namespace)


def _check_federated(self) -> None:
    try:
        self.settings(seed=0)
    except FederationSettingsError as exc:
        key, value, expected = exc.problems[0]
        raise FieldError(type(self), key, value, expected) from None
    self.need(self.num_cpus >= 1, "num_cpus", "an integer >= 1")
    self.need(self.finetune_epochs >= 0, "finetune_epochs", "an integer >= 0")


def _settings(self, seed: int) -> FederationSettings:
    """The federation's settings from this section and the configuration's seed."""
    values = {f.name: getattr(self, f.name) for f in fields(FederationSettings) if hasattr(self, f.name)}
    values.update(dp=DPSettings(**asdict(self.dp)), secagg=SecAggSettings(**asdict(self.secagg)),
                  strategy_options=dict(self.strategy_options or {}), seed=int(seed))
    return FederationSettings(**values)


DPConfig = _section("DPConfig", DPSettings)
SecAggConfig = _section("SecAggConfig", SecAggSettings)
FederatedConfig = _section("FederatedConfig", FederationSettings, leave_out=("seed",),
                           nested={"dp": DPConfig, "secagg": SecAggConfig},
                           extra=[("finetune_epochs", int, field(default=MISSING)),
                                  ("population", PopulationConfig, field(default_factory=PopulationConfig)),
                                  ("num_cpus", int, field(default=MISSING))],
                           methods={"check": _check_federated, "settings": _settings})

CONFIG = {"federated": FederatedConfig}


# --------------------------------------------------------------------------- the stage


def run(cfg, paths: Paths, tracker: NullRun = NO_TRACKING) -> dict:
    from odt_ops.api import CheckpointState, Module
    from odt_ops.federated import LocalTrainer, RoundConfig, save_encoded
    from odt_ops.federated.simulation import simulate
    from odt_ops.federated.task import central_evaluation

    gen = inputs.generated(paths)
    f = cfg.federated
    test = inputs.load_split(paths, "global_test")
    population = users.population(cfg, paths)
    inputs.check_fits(inputs.Split("federated users", paths.out("prepare"), population.user(0)[0], population.user(0)[1]),
                        gen.eval_model, paths)
    settings = f.settings(cfg.seed)
    test_t = population.targets(test.y)
    with _console_log() as console:
        result = simulate(gen.directory, population.data, settings, evaluate_fn=central_evaluation(gen.directory, test.x, test_t),
                          num_cpus=int(f.num_cpus), progress=console.progress)
    out = paths.out("federate")

    # the global model: generate's checkpoint with the federation's trainable parameters, and its inference model
    state = CheckpointState.load_checkpoint(gen.checkpoint)
    for name, value in result.parameters.items():
        state.parameters[name].data = value
    CheckpointState.save_checkpoint(state, out / "checkpoint")
    module = Module(gen.training_model, state, gen.eval_model)
    inference.export_inference(module, paths.federated_model, cfg.export.ir_version)

    # the last round's updates, as the clients sent them
    (out / "diffs").mkdir(parents=True, exist_ok=True)
    for cid, enc in sorted(result.last_updates.items()):
        save_encoded(enc, out / "diffs" / f"client_{cid:04d}.odtdiff")

    # what federation buys, on every user's holdout: base, local-only, the global model, global + fine-tune
    trainer = LocalTrainer(gen.directory)
    base = {k: v.copy() for k, v in trainer.base.items()}
    tune = dict(epochs=int(f.finetune_epochs), batch_size=int(f.batch_size), learning_rate=float(f.lr), seed=int(cfg.seed),
                server_round=10**6)
    # keyed by the strategy that ran (fedprox, fedadam, ...), as its metrics are
    ran, ran_tuned = settings.strategy, f"{settings.strategy}_finetune"
    sums = {"base": 0.0, "local_only": 0.0, ran: 0.0, ran_tuned: 0.0}
    n_holdout = 0
    for cid in range(int(f.clients)):
        d = population.data(cid)
        w = len(d.y_holdout)
        n_holdout += w
        sums["base"] += w * trainer.evaluate(base, d.x_holdout, d.y_holdout).accuracy
        sums[ran] += w * trainer.evaluate(result.parameters, d.x_holdout, d.y_holdout).accuracy
        if f.finetune_epochs:
            local = trainer.train_round(base, d.x, d.y, RoundConfig(client_id=cid, **tune))
            sums["local_only"] += w * trainer.evaluate(local.parameters, d.x_holdout, d.y_holdout).accuracy
            tuned = trainer.train_round(result.parameters, d.x, d.y, RoundConfig(client_id=cid, **tune))
            sums[ran_tuned] += w * trainer.evaluate(tuned.parameters, d.x_holdout, d.y_holdout).accuracy
    holdout = {k: v / n_holdout for k, v in sums.items() if f.finetune_epochs or k in ("base", ran)}

    rows = [_row(0, client_eval={"accuracy": holdout["base"]}, server_eval=result.initial_server_eval)]
    rows += [_row(r.round, r, r.client_eval, r.server_eval) for r in result.rounds]
    _write_rounds(out / "rounds.csv", rows)
    history = result.history()
    write_json(out / "rounds.json", {"clients": int(f.clients), "strategy": settings.strategy, "encoding": settings.encoding,
                                     "rounds": [{k: v for k, v in h.items() if k != "seconds"} for h in history]})
    for row in rows:
        step = int(row["round"])
        for key in ("participants", "client_accuracy", "client_loss", "global_test_accuracy", "global_test_loss", "bytes_up",
                    "bytes_down", "dropped"):
            if row[key] != "":
                tracker.log_metric(f"round.{key}", float(row[key]), step)
    for r in result.rounds:
        tracker.log_metric("round.seconds", r.seconds, r.round)

    trained = [r for r in result.rounds if r.participants]
    final_test = result.rounds[-1].server_eval if result.rounds else result.initial_server_eval
    metrics = {
        "global_test.accuracy_initial": result.initial_server_eval.get("accuracy", float("nan")),
        "global_test.accuracy": final_test.get("accuracy", float("nan")),
        "global_test.loss": final_test.get("loss", float("nan")),
        **{f"holdout.{k}": v for k, v in holdout.items()},
        "rounds": int(f.rounds),
        "clients": int(f.clients),
        "participants_per_round": float(np.mean([r.participants for r in result.rounds])) if result.rounds else 0.0,
        "dropped": int(sum(len(r.dropped) for r in result.rounds)),
        "rounds_kept_global": int(sum(r.kept_global for r in result.rounds)),
        "bytes.up_per_client_round": float(np.mean([r.bytes_up / r.participants for r in trained])) if trained else 0.0,
        "bytes.payload_up_per_client_round": float(np.mean([r.payload_bytes_up / r.participants for r in trained])) if trained else 0.0,
        "bytes.down_per_round": float(np.mean([r.bytes_down for r in result.rounds])) if result.rounds else 0.0,
    }
    write_json(paths.metrics("federate"), nest(metrics))
    return {**metrics, "seconds": result.seconds, "seconds_per_round": float(np.mean([r.seconds for r in result.rounds] or [0.0]))}


def _row(round_: int, rec=None, client_eval=None, server_eval=None) -> dict:
    client_eval, server_eval = client_eval or {}, server_eval or {}

    def get(d, k):
        return f"{d[k]:.6g}" if k in d else ""

    return {"round": round_, "sampled": rec.sampled if rec else 0, "participants": rec.participants if rec else 0,
            "dropped": len(rec.dropped) if rec else 0, "kept_global": int(rec.kept_global) if rec else 0,
            "client_accuracy": get(client_eval, "accuracy"), "client_loss": get(client_eval, "loss"),
            "global_test_accuracy": get(server_eval, "accuracy"), "global_test_loss": get(server_eval, "loss"),
            "bytes_up": rec.bytes_up if rec else 0, "bytes_down": rec.bytes_down if rec else 0,
            "payload_bytes_up": rec.payload_bytes_up if rec else 0}


def _write_rounds(path: Path, rows: list[dict]) -> None:
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=ROUND_COLUMNS, lineterminator="\n")
    w.writeheader()
    w.writerows(rows)
    atomic_write_text(path, buf.getvalue())


class _console_log:
    """Dropped clients and kept rounds (logger odt_ops.federated) on stderr, one line each;
    on a terminal also one line per round as it ends (as the train stage shows its bar on a
    terminal only), nothing per round on a pipe (dvc queue, CI)."""

    def __init__(self, stream=None):
        self.stream = stream or sys.stderr

    def progress(self, rec, settings) -> None:
        if self.stream.isatty():
            from odt_ops.federated.server_app import describe_round

            print(f"federate: {describe_round(rec, settings)}", file=self.stream, flush=True)

    def __enter__(self):
        self.handler = logging.StreamHandler(self.stream)
        self.handler.setFormatter(logging.Formatter("federate: %(message)s"))
        self.logger = logging.getLogger("odt_ops.federated")
        self.logger.addHandler(self.handler)
        self.level = self.logger.level
        self.logger.setLevel(logging.WARNING)
        return self

    def __exit__(self, *exc):
        self.logger.removeHandler(self.handler)
        self.logger.setLevel(self.level)
        return False


def after(cfg, paths: Paths, tracker) -> None:
    """The global model as an MLflow model (onnx flavor, an input example from the global test)."""
    example = inputs.load_split(paths, "global_test").x[:2]
    tracker.log_onnx_model(paths.federated_model, example, name="global_model")


def describe(metrics: dict) -> str:
    h = {k.split(".", 1)[1]: v for k, v in metrics.items() if k.startswith("holdout.")}
    shown = ", ".join(f"{k} {v:.3f}" for k, v in h.items())
    return (f"global test {metrics['global_test.accuracy_initial']:.3f} -> {metrics['global_test.accuracy']:.3f}; users' holdouts: {shown}; "
            f"{metrics['bytes.up_per_client_round']:.0f} B up per client and round")


def main(argv=None) -> int:
    from pipeline.stage import main as stage_main

    return stage_main("federate", run, argv, after=after, describe=describe, datasets={"global_test": "evaluation"},
                      headline=HEADLINE)


if __name__ == "__main__":  # run the imported pipeline.<module>, whose classes the configuration holds (pipeline/stage.py)
    sys.exit(importlib.import_module(__spec__.name).main())
