"""Secure aggregation with Flower's SecAgg+ (``federated.secagg.enabled``).

Flower 1.42 runs SecAgg+ in its legacy server loop: ``DefaultWorkflow`` with a
``SecAggPlusWorkflow`` as the fit step and a legacy strategy, over the same Grid, and
``secaggplus_mod`` on each client. Per training round the server sends four messages
to each sampled client instead of one (setup; share keys; collect masked vectors;
unmask): each client secret-shares its keys with ``num_shares`` others, clips its
update's values to ``[-clipping_range, clipping_range]``, weights it by its example
count (capped at ``max_weight`` by our client: ``fitres``), quantizes it to ``quantization_range`` levels and adds
pairwise masks that cancel in the sum. The server unmasks only the sum: it learns the
weighted mean of the sampled clients' updates, never one client's.

What travels is the client's model difference (not its weights), so the clipping range
bounds the change of a round and the quantization step ``2 * clipping_range /
quantization_range`` is small against it. ``_DeltaFedAvg`` (Flower's legacy FedAvg,
weighted by the example counts) adds the securely averaged difference to the global
model. What SecAgg+ does not provide here: the per-update checks of ``GuardedStrategy``
(the server never sees an update to check), seeded client sampling (the legacy loop
samples with Python's unseeded ``random``). A round's bytes count everything the four
stages and the evaluation carry (keys, shares, masked vectors, parameters).
"""
from __future__ import annotations

import time
from collections.abc import Mapping

import numpy as np
from flwr.app import Context, Message, RecordDict
from flwr.clientapp.typing import ClientAppCallable
from flwr.common import Code, EvaluateRes, FitRes, Status, ndarrays_to_parameters, parameters_to_ndarrays
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS
from flwr.compat.common import recorddict_compat as compat
from flwr.serverapp import Grid

from odt_ops.federated.local import RoundResult
from odt_ops.federated.record import RoundRecord
from odt_ops.federated.settings import FederationSettings
from odt_ops.federated.task import WEIGHT_KEY, EvaluateFn, train_config


def secagg_when_asked(msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
    """Flower's ``secaggplus_mod`` for the messages of a SecAgg+ round (they carry its
    configs record); every other message goes straight to the app."""
    if RECORD_KEY_CONFIGS in msg.content.config_records:
        from flwr.client.mod import secaggplus_mod

        return secaggplus_mod(msg, context, call_next)
    return call_next(msg, context)


# ---------------------------------------------------------------------------------- client side


def is_legacy_train(msg: Message) -> bool:
    return "fitins.parameters" in msg.content.array_records


def is_legacy_evaluate(msg: Message) -> bool:
    return "evaluateins.parameters" in msg.content.array_records


def _named(parameters, names: list[str]) -> dict[str, np.ndarray]:
    arrays = parameters_to_ndarrays(parameters)
    if len(arrays) != len(names):
        from odt_ops.errors import ModelDiffError

        raise ModelDiffError(f"the server sent {len(arrays)} tensors; the artifacts train {len(names)} ({', '.join(names)})")
    return dict(zip(names, arrays, strict=True))


def read_fitins(msg: Message, names: list[str]) -> tuple[dict[str, np.ndarray], dict]:
    """(global parameters by name, the round's config) from a legacy training message."""
    ins = compat.recorddict_to_fitins(msg.content, keep_input=True)
    return _named(ins.parameters, names), dict(ins.config)


def read_evaluateins(msg: Message, names: list[str]) -> dict[str, np.ndarray]:
    return _named(compat.recorddict_to_evaluateins(msg.content, keep_input=True).parameters, names)


# the fit config's key for SecAgg+'s max_weight: the client caps its example count at it
MAX_WEIGHT_KEY = "secagg-max-weight"


def fitres(res: RoundResult, max_weight: float) -> RecordDict:
    """The reply secaggplus_mod masks: the exact float32 difference (in the artifacts'
    parameter order) and the example count it is weighted by, at most ``max_weight``.

    Why the cap is ours: secaggplus_mod multiplies the update by ``num_examples / max_weight``
    before clipping it to the clipping range, and above 1 it only logs a warning
    (flwr/client/mod/secure_aggregation/secaggplus_mod.py), so an honest client with more
    examples than ``max_weight`` had its update scaled past the range and clipped: a distorted
    mean, in silence. Capped, such a client weighs ``max_weight``, as the settings say."""
    deltas = [np.asarray(v, np.float32) for v in res.diff.deltas.values()]
    metrics = {k: float(v) for k, v in res.metrics.items() if k not in ("seconds", "train_loss_last")}
    weight = min(int(res.num_examples), int(max_weight))
    return compat.fitres_to_recorddict(FitRes(Status(Code.OK, ""), ndarrays_to_parameters(deltas), weight, metrics), keep_input=True)


def evaluateres(metrics: Mapping[str, float]) -> RecordDict:
    extra = {k: float(v) for k, v in metrics.items() if k != WEIGHT_KEY}  # the loss too: the server's metrics aggregate it
    return compat.evaluateres_to_recorddict(EvaluateRes(Status(Code.OK, ""), float(metrics["loss"]), int(metrics[WEIGHT_KEY]), extra))


# ---------------------------------------------------------------------------------- server side


def record_bytes(content: RecordDict) -> int:
    """Bytes a message's records carry: its arrays and the bytes values of its config
    records (SecAgg+'s keys, shares and masked vectors travel there)."""
    n = sum(rec.count_bytes() for rec in content.array_records.values())
    for rec in content.config_records.values():
        for value in rec.values():
            n += sum(len(v) for v in (value if isinstance(value, list) else [value]) if isinstance(v, bytes))
    return n


class _CountingGrid:
    """The grid with every message's bytes added to the current round's record."""

    def __init__(self, grid: Grid, on_bytes):
        self._grid, self._on_bytes = grid, on_bytes

    def send_and_receive(self, messages, *, timeout=None):
        messages = list(messages)
        down = sum(record_bytes(m.content) for m in messages)
        replies = list(self._grid.send_and_receive(messages, timeout=timeout))
        self._on_bytes(down, sum(record_bytes(r.content) for r in replies if not r.has_error()))
        return replies

    def __getattr__(self, name: str):
        return getattr(self._grid, name)


def _weighted(results: list[tuple[int, dict]]) -> dict[str, float]:
    total = sum(n for n, _ in results)
    keys = set.intersection(*(set(m) for _, m in results)) if results else set()
    return {k: sum(n * float(m[k]) for n, m in results) / total for k in sorted(keys)} if total else {}


def run_secure_federation(grid: Grid, context: Context, start: dict[str, np.ndarray], settings: FederationSettings, *,
                          evaluate_fn: EvaluateFn | None = None, progress=None):
    """The server's side of a SecAgg+ federation on ``grid``: (final parameters, round
    records, initial server evaluation)."""
    from flwr.server import LegacyContext, ServerConfig
    from flwr.server.strategy import FedAvg
    from flwr.server.workflow import DefaultWorkflow, SecAggPlusWorkflow


    names = list(start)
    records: dict[int, RoundRecord] = {}
    server_eval: dict[int, dict[str, float]] = {}
    clock = {"round": 1, "started": time.monotonic()}

    def record(r: int) -> RoundRecord:
        return records.setdefault(r, RoundRecord(r))

    class _DeltaFedAvg(FedAvg):
        """Flower's FedAvg over the clients' differences: the new global model is the old one
        plus their weighted mean (which is all SecAggPlusWorkflow hands it)."""

        current: list[np.ndarray] = [start[k] for k in names]

        def configure_fit(self, server_round, parameters, client_manager):
            self.current = parameters_to_ndarrays(parameters)
            clock.update(round=server_round, started=time.monotonic())
            pairs = super().configure_fit(server_round, parameters, client_manager)
            record(server_round).sampled = len(pairs)
            return pairs

        def aggregate_fit(self, server_round, results, failures):
            mean_delta, metrics = super().aggregate_fit(server_round, results, failures)
            if mean_delta is None:
                record(server_round).kept_global = True
                return None, metrics
            new = [(g + d).astype(g.dtype) for g, d in zip(self.current, parameters_to_ndarrays(mean_delta), strict=True)]
            return ndarrays_to_parameters(new), metrics

    def fit_metrics(results):
        rec = record(clock["round"])
        rec.participants = len(results)
        rec.train_metrics = _weighted(results)
        return rec.train_metrics

    def evaluate_metrics(results):
        rec = record(clock["round"])
        rec.client_eval, rec.client_eval_count = _weighted(results), len(results)
        rec.seconds = time.monotonic() - clock["started"]
        if progress is not None:
            progress(rec, settings)
        return rec.client_eval

    def central(server_round, arrays, config):
        if evaluate_fn is None:
            return None
        out = evaluate_fn(server_round, dict(zip(names, arrays, strict=True)))
        if out is None:
            return None
        server_eval[server_round] = {k: float(v) for k, v in out.items()}
        record(server_round).server_eval = server_eval[server_round] if server_round else {}
        return float(out.get("loss", float("nan"))), dict(server_eval[server_round])

    n = settings.clients
    strategy = _DeltaFedAvg(
        fraction_fit=settings.fraction_train, fraction_evaluate=settings.fraction_evaluate,
        min_fit_clients=min(n, settings.min_train_clients), min_evaluate_clients=min(n, settings.min_evaluate_clients),
        min_available_clients=n, evaluate_fn=central,
        on_fit_config_fn=lambda r: {**dict(train_config(settings)), "server-round": int(r), MAX_WEIGHT_KEY: float(settings.secagg.max_weight)},
        initial_parameters=ndarrays_to_parameters([start[k] for k in names]),
        fit_metrics_aggregation_fn=fit_metrics, evaluate_metrics_aggregation_fn=evaluate_metrics,
    )
    s = settings.secagg
    legacy = LegacyContext(context=context, config=ServerConfig(num_rounds=int(settings.rounds), round_timeout=settings.round_timeout),
                           strategy=strategy)
    workflow = DefaultWorkflow(fit_workflow=SecAggPlusWorkflow(
        num_shares=s.num_shares, reconstruction_threshold=s.reconstruction_threshold, max_weight=s.max_weight,
        clipping_range=s.clipping_range, quantization_range=s.quantization_range, timeout=settings.round_timeout))
    def count(down: int, up: int) -> None:
        rec = record(clock["round"])
        rec.bytes_down += down
        rec.bytes_up += up

    workflow(_CountingGrid(grid, count), legacy)
    from flwr.server.workflow.constant import MAIN_PARAMS_RECORD

    final = legacy.state.array_records[MAIN_PARAMS_RECORD]
    arrays = parameters_to_ndarrays(compat.arrayrecord_to_parameters(final, keep_input=True))
    params = {k: np.asarray(a, start[k].dtype) for k, a in zip(names, arrays, strict=True)}
    rounds = [records.get(r, RoundRecord(r)) for r in range(1, int(settings.rounds) + 1)]
    for rec in rounds:
        rec.server_eval = server_eval.get(rec.round, {})
    return params, rounds, server_eval.get(0, {})
