"""federate: federated learning of the generated artifacts over a population of
simulated users, on Flower (odt_ops.federated.flower: Flower's simulation engine runs the
clients on Ray, one CPU and one BLAS thread each; odt_ops is every client's trainer;
Flower's strategy, optionally inside its differential-privacy wrapper, aggregates).

The population (``federated.population``): each client is one user with their own
handwriting, a slant drawn from ``slant_deg`` and a pen width from ``strokes``, and their
own label mix (Dirichlet, ``label_alpha``), made the way the personalization demo makes
its user (``datasets.render_style``) from the bundled digits that neither the cloud's
training set nor the global test holds. A user's samples are made when that client
is asked for them, from ``(seed, client id)``: nothing holds every client's data.

What is trained is what ``generate`` made trainable (the head by default), with its
optimizer (fresh each round) at ``federated.lr``; the clients send model differences in
``federated.encoding``.

Outputs (data/federate/): ``checkpoint`` (generate's checkpoint with the global
trainable parameters: artifacts-compatible), ``inference.onnx``, ``rounds.csv`` (per
round: participants, accuracy and loss on the clients' holdouts and on the global test,
bytes up and down, for ``dvc plots``), ``rounds.json`` (the same with every dropped
client's reason), ``diffs/client_NNNN.odtdiff`` (the last round's updates as sent),
``metrics.json``: the global model and, over every user's holdout, the comparison
base / local-only (fine-tune the base on the user's own data) / FedAvg global model /
FedAvg + local fine-tune. MLflow: one run per federation with the per-round metrics
(step = round) and the final global model.
"""
from __future__ import annotations

import csv
import importlib
import io
import logging
import sys
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

import numpy as np

from pipeline import datasets, training
from pipeline.config import MISSING, Section
from pipeline.errors import DataError
from pipeline.io import atomic_write_text, nest, write_json
from pipeline.paths import Artifacts, Paths
from pipeline.tracking import NullRun

ROUND_COLUMNS = ("round", "sampled", "participants", "dropped", "kept_global", "client_accuracy", "client_loss",
                 "global_test_accuracy", "global_test_loss", "bytes_up", "bytes_down", "payload_bytes_up")


# --------------------------------------------------------------------------- the federated section


class StrategyName(Enum):  # Flower's strategies (odt_ops.federated.flower.STRATEGIES; a test keeps the two equal)
    fedavg = "fedavg"
    fedprox = "fedprox"
    fedadam = "fedadam"
    fedyogi = "fedyogi"
    fedadagrad = "fedadagrad"
    fedavgm = "fedavgm"
    fedmedian = "fedmedian"
    fedtrimmedavg = "fedtrimmedavg"
    krum = "krum"
    multikrum = "multikrum"
    bulyan = "bulyan"


class DiffEncoding(Enum):
    float32 = "float32"
    float16 = "float16"
    int8 = "int8"


class DPMode(Enum):
    server_fixed = "server_fixed"
    server_adaptive = "server_adaptive"
    client_fixed = "client_fixed"


@dataclass
class DPConfig(Section):
    enabled: bool = MISSING
    mode: DPMode = MISSING
    noise_multiplier: float = MISSING
    clipping_norm: float = MISSING

    def check(self) -> None:
        self.need(self.noise_multiplier >= 0, "noise_multiplier", "a number >= 0")
        self.need(self.clipping_norm > 0, "clipping_norm", "a number > 0")


@dataclass
class PopulationConfig(Section):
    """The simulated users (see Population below)."""

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


@dataclass
class FederatedConfig(Section):
    strategy: StrategyName = MISSING
    strategy_options: dict[str, Any] = MISSING
    rounds: int = MISSING
    clients: int = MISSING
    fraction_train: float = MISSING
    fraction_evaluate: float = MISSING
    min_successful_clients: int = MISSING
    local_epochs: int = MISSING
    batch_size: int = MISSING
    lr: float = MISSING
    mu: float = MISSING
    encoding: DiffEncoding = MISSING
    dp: DPConfig = field(default_factory=DPConfig)
    finetune_epochs: int = MISSING
    population: PopulationConfig = field(default_factory=PopulationConfig)
    num_cpus: int = MISSING

    def check(self) -> None:
        for key in ("rounds", "clients", "local_epochs", "batch_size", "min_successful_clients", "num_cpus"):
            self.need(getattr(self, key) >= 1, key, "an integer >= 1")
        self.need(self.finetune_epochs >= 0, "finetune_epochs", "an integer >= 0")
        self.need(self.min_successful_clients <= self.clients, "min_successful_clients", f"at most federated.clients ({self.clients})")
        for key in ("fraction_train", "fraction_evaluate"):
            self.need(0 < getattr(self, key) <= 1, key, "a number in (0, 1]")
        self.need(self.lr > 0, "lr", "a number > 0")
        self.need(self.mu >= 0, "mu", "a number >= 0 (0: no proximal term)")


CONFIG = {"federated": FederatedConfig}


# --------------------------------------------------------------------------- the population


def client_pool(global_train: training.Split, global_test: training.Split) -> tuple[np.ndarray, np.ndarray]:
    """The bundled digits that are in neither the cloud's training set nor the global test."""
    x, y = datasets.load_digits_demo()
    taken = {row.tobytes() for split in (global_train, global_test) for row in np.ascontiguousarray(split.x, np.float32)}
    keep = np.array([row.tobytes() not in taken for row in np.ascontiguousarray(x, np.float32)])
    if keep.sum() < 20:
        raise DataError(f"only {int(keep.sum())} digits are left for the federated users once the cloud's are set aside; "
                        "lower data.test_fraction or raise data.user_samples")
    return x[keep], y[keep]


@dataclass
class Population:
    """Simulated users, made on demand from (seed, client id); picklable, so Ray's workers
    make the data of the clients they play themselves."""

    pool_x: np.ndarray
    pool_y: np.ndarray
    seed: int
    train_per_client: int
    holdout_per_client: int
    label_alpha: float
    slant_deg: tuple[float, float]
    strokes: tuple[int, ...]
    jitter_deg: float
    num_classes: int = 10
    one_hot: str | None = None  # the label input's dtype when it takes one-hot rows (mse, l1, bce losses)
    _cache: dict = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_config(cls, cfg, pool: tuple[np.ndarray, np.ndarray], one_hot: str | None = None) -> "Population":
        p = cfg.federated.population
        return cls(pool[0], pool[1], int(cfg.seed), int(p.train_per_client), int(p.holdout_per_client), float(p.label_alpha),
                   (float(p.slant_deg[0]), float(p.slant_deg[1])), tuple(int(s) for s in p.strokes), float(p.jitter_deg),
                   int(cfg.data.num_classes), one_hot)

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_cache"] = {}
        return state

    def style(self, cid: int) -> dict:
        rng = np.random.default_rng([self.seed, 1789, cid])
        return {"slant_deg": float(rng.uniform(*self.slant_deg)), "stroke": int(rng.choice(self.strokes)),
                "class_mix": rng.dirichlet(np.full(self.num_classes, self.label_alpha)).tolist()}

    def user(self, cid: int):
        """(x_train, y_train, x_holdout, y_holdout) of user ``cid`` (class ids)."""
        if cid in self._cache:
            return self._cache[cid]
        style = self.style(cid)
        rng = np.random.default_rng([self.seed, 1790, cid])
        n = self.train_per_client + self.holdout_per_client
        counts = rng.multinomial(n, style["class_mix"])
        picked = []
        for c in range(self.num_classes):
            avail = np.flatnonzero(self.pool_y == c)
            k = min(int(counts[c]), len(avail))
            picked.extend(rng.choice(avail, k, replace=False).tolist())
        idx = rng.permutation(np.array(picked, dtype=np.int64))
        x = datasets.render_style(self.pool_x[idx], slant_deg=style["slant_deg"], stroke=style["stroke"], jitter_deg=self.jitter_deg,
                                  shift=[0.0, 0.0], rng=rng)
        y = self.pool_y[idx]
        k = max(1, min(len(idx) - 1, round(len(idx) * self.train_per_client / n)))
        out = (x[:k], y[:k], x[k:], y[k:])
        if len(self._cache) >= 64:
            self._cache.pop(next(iter(self._cache)))
        self._cache[cid] = out
        return out

    def targets(self, y: np.ndarray) -> np.ndarray:
        if self.one_hot is None:
            return y.astype(np.int64)
        out = np.zeros((len(y), self.num_classes), dtype=np.dtype(self.one_hot))
        out[np.arange(len(y)), y] = 1
        return out

    def data(self, cid: int, context=None):
        """What the ClientApp asks: this user's samples (odt_ops.federated.flower.ClientData)."""
        from odt_ops.federated.flower import ClientData

        x, y, xh, yh = self.user(int(cid))
        return ClientData(x, self.targets(y), xh, self.targets(yh))


def _one_hot_dtype(gen: Artifacts) -> str | None:
    probe = training.target_encoder(gen.training_model)(np.array([0]))
    return None if probe.ndim == 1 else probe.dtype.str


# --------------------------------------------------------------------------- the stage


def settings_of(cfg):
    """The federation's settings (odt_ops.federated.flower.FederationSettings) from ``federated``."""
    from odt_ops.federated.flower import DPSettings, FederationSettings

    f = cfg.federated
    return FederationSettings(
        strategy=f.strategy.value, strategy_options=dict(f.strategy_options or {}),
        rounds=int(f.rounds), num_clients=int(f.clients), fraction_train=float(f.fraction_train),
        fraction_evaluate=float(f.fraction_evaluate), min_train_clients=1, min_evaluate_clients=1,
        min_successful_clients=int(f.min_successful_clients), local_epochs=int(f.local_epochs), batch_size=int(f.batch_size),
        learning_rate=float(f.lr), proximal_mu=float(f.mu), encoding=f.encoding.value,
        dp=DPSettings(enabled=bool(f.dp.enabled), mode=f.dp.mode.value, noise_multiplier=float(f.dp.noise_multiplier),
                      clipping_norm=float(f.dp.clipping_norm)),
        seed=int(cfg.seed),
    )


def run(cfg, paths: Paths, tracker=NullRun()) -> dict:
    from odt_ops.api import CheckpointState, Module
    from odt_ops.federated import LocalTrainer, RoundConfig, save_encoded
    from odt_ops.federated.flower import central_evaluation, simulate

    gen = training.generated(paths)
    f = cfg.federated
    test = training.load_split(paths, "global_test")
    pool = client_pool(training.load_split(paths, "global_train"), test)
    population = Population.from_config(cfg, pool, _one_hot_dtype(gen))
    training.check_fits(training.Split("federated users", paths.out("prepare"), population.user(0)[0], population.user(0)[1]),
                        gen.eval_model, paths)
    settings = settings_of(cfg)
    test_t = population.targets(test.y)
    with _console_log():
        result = simulate(gen.directory, population.data, settings, evaluate_fn=central_evaluation(gen.directory, test.x, test_t),
                          num_cpus=int(f.num_cpus))
    out = paths.out("federate")

    # the global model: generate's checkpoint with the federation's trainable parameters, and its inference model
    state = CheckpointState.load_checkpoint(gen.checkpoint)
    for name, value in result.parameters.items():
        state.parameters[name].data = value
    CheckpointState.save_checkpoint(state, out / "checkpoint")
    module = Module(gen.training_model, state, gen.eval_model)
    training.export_inference(module, paths.federated_model, cfg.export.ir_version)

    # the last round's updates, as the clients sent them
    (out / "diffs").mkdir(parents=True, exist_ok=True)
    for cid, enc in sorted(result.last_updates.items()):
        save_encoded(enc, out / "diffs" / f"client_{cid:04d}.odtdiff")

    # what federation buys, on every user's holdout: base, local-only, the global model, global + fine-tune
    trainer = LocalTrainer(gen.directory)
    base = {k: v.copy() for k, v in trainer.base.items()}
    tune = dict(epochs=int(f.finetune_epochs), batch_size=int(f.batch_size), learning_rate=float(f.lr), seed=int(cfg.seed),
                server_round=10**6)
    sums = {"base": 0.0, "local_only": 0.0, "fedavg": 0.0, "fedavg_finetune": 0.0}
    n_holdout = 0
    for cid in range(int(f.clients)):
        d = population.data(cid)
        w = len(d.y_holdout)
        n_holdout += w
        sums["base"] += w * trainer.evaluate(base, d.x_holdout, d.y_holdout).accuracy
        sums["fedavg"] += w * trainer.evaluate(result.parameters, d.x_holdout, d.y_holdout).accuracy
        if f.finetune_epochs:
            local = trainer.train_round(base, d.x, d.y, RoundConfig(client_id=cid, **tune))
            sums["local_only"] += w * trainer.evaluate(local.parameters, d.x_holdout, d.y_holdout).accuracy
            tuned = trainer.train_round(result.parameters, d.x, d.y, RoundConfig(client_id=cid, **tune))
            sums["fedavg_finetune"] += w * trainer.evaluate(tuned.parameters, d.x_holdout, d.y_holdout).accuracy
    holdout = {k: v / n_holdout for k, v in sums.items() if f.finetune_epochs or k in ("base", "fedavg")}

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
    """Dropped clients and kept rounds (logger odt_ops.federated) on stderr, one line each."""

    def __enter__(self):
        self.handler = logging.StreamHandler(sys.stderr)
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
    example = training.load_split(paths, "global_test").x[:2]
    tracker.log_onnx_model(paths.federated_model, example, name="global_model")


def describe(metrics: dict) -> str:
    h = {k.split(".", 1)[1]: v for k, v in metrics.items() if k.startswith("holdout.")}
    shown = ", ".join(f"{k} {v:.3f}" for k, v in h.items())
    return (f"global test {metrics['global_test.accuracy_initial']:.3f} -> {metrics['global_test.accuracy']:.3f}; users' holdouts: {shown}; "
            f"{metrics['bytes.up_per_client_round']:.0f} B up per client and round")


def main(argv=None) -> int:
    from pipeline.stage import main as stage_main

    return stage_main("federate", run, argv, after=after, describe=describe, datasets={"global_test": "evaluation"})


if __name__ == "__main__":  # run the imported pipeline.<module>, whose classes the configuration holds (pipeline/stage.py)
    sys.exit(importlib.import_module(__spec__.name).main())
