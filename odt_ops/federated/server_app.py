"""Flower's ServerApp around the engine: Flower's strategy (FedAvg, FedProx, FedAdam, ...,
optionally in one of Flower's differential-privacy wrappers) runs the rounds; the
``GuardedStrategy`` between Flower's loop and that strategy

- decodes every update and turns it into the full parameters (global + difference) the
  Flower strategy averages, so every strategy and DP wrapper works unchanged;
- drops a client that failed, sent non-finite values or parameters of the wrong names
  or shapes, or trained from another base than the round's global model, logging
  the reason (logger ``odt_ops.federated``) and recording it in the round's history;
- keeps the global model as it was, and says so, when fewer than
  ``min_successful_clients`` updates survive;
- makes a run repeatable: clients are identified by their ``partition-id`` (asked
  once with a query message), sampling goes through Flower's own sampler over the
  clients in id order with Python's ``random`` seeded per round, replies are
  aggregated in client order, and DP noise comes from numpy's generator seeded per
  round. The same seed gives the same global model bits;
- reports each round, as it ends, to a ``progress`` callback (``RoundRecord``).

The repository's Flower App (``flwr run .``) uses ``pipeline.flower_app:server``; in code,
``server_app(artifacts, settings)`` builds one for any artifacts.
"""
from __future__ import annotations

import contextlib
import logging
import math
import os
import random
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp import strategy as fl

from odt_ops.errors import ArgumentError, ModelDiffError
from odt_ops.export import check_count
from odt_ops.federated.encoding import EncodedDiff, check_update, decode_diff, fingerprint
from odt_ops.federated.record import RoundRecord
from odt_ops.federated.settings import STRATEGY_NAMES, FederationSettings
from odt_ops.federated.task import ARRAYS, METRICS, ODT, WEIGHT_KEY, EvaluateFn, decode_reply, initial_parameters, train_config

log = logging.getLogger("odt_ops.federated")

# Flower's strategies by name
STRATEGIES: dict[str, type] = {
    "fedavg": fl.FedAvg,
    "fedprox": fl.FedProx,
    "fedadam": fl.FedAdam,
    "fedyogi": fl.FedYogi,
    "fedadagrad": fl.FedAdagrad,
    "fedavgm": fl.FedAvgM,
    "fedmedian": fl.FedMedian,
    "fedtrimmedavg": fl.FedTrimmedAvg,
    "krum": fl.Krum,
    "multikrum": fl.MultiKrum,
    "bulyan": fl.Bulyan,
}
assert tuple(STRATEGIES) == STRATEGY_NAMES  # settings.py names them without importing Flower


class _OrderedGrid:
    """The grid as a strategy sees it: node ids in client-id order (so Flower's sampler,
    seeded, picks the same clients whatever ids the nodes drew)."""

    def __init__(self, grid: Grid, order: list[int]):
        self._grid, self._order = grid, order

    def get_node_ids(self) -> list[int]:
        return list(self._order)

    def __getattr__(self, name: str):
        return getattr(self._grid, name)


@contextlib.contextmanager
def _seeded(seed: int, round_: int, salt: int) -> Iterator[None]:
    """Python's and numpy's global generators seeded for one step of one round (Flower's
    sampler and DP noise draw from them), restored afterwards."""
    py_state, np_state = random.getstate(), np.random.get_state()
    s = (int(seed) * 1_000_003 + int(round_) * 7 + int(salt)) % (2**32)
    random.seed(s)
    np.random.seed(s)
    try:
        yield
    finally:
        random.setstate(py_state)
        np.random.set_state(np_state)


class GuardedStrategy(fl.Strategy):
    """A Flower strategy wrapped for odt updates: decode, check, order, seed (see the module docstring)."""

    def __init__(self, inner: fl.Strategy, *, specs: Mapping[str, tuple[tuple[int, ...], np.dtype]], seed: int = 0,
                 min_successful: int = 1, expected_clients: int = 1, connect_timeout: float = 120.0, keep_last_updates: bool = True):
        super().__init__()
        self.inner = inner
        self.specs = dict(specs)
        self.seed = int(seed)
        self.min_successful = int(min_successful)
        self.expected_clients = int(expected_clients)
        self.connect_timeout = float(connect_timeout)
        self.keep_last_updates = keep_last_updates
        self.client_of_node: dict[int, int] = {}
        self.history: dict[int, RoundRecord] = {}
        self.last_updates: dict[int, EncodedDiff] = {}
        self._current: dict[str, np.ndarray] = {}
        self._current_hash = ""
        self._started: dict[int, float] = {}
        self.query_seconds = 0.0

    # ---- who is who ----------------------------------------------------------------------------
    def known_order(self, grid: Grid) -> list[int]:
        """Every connected node's id, ordered by client id (asking new nodes theirs once)."""
        t0 = time.monotonic()
        nodes = ask_client_ids(grid, self.expected_clients, self.connect_timeout, self.client_of_node)
        self.query_seconds += time.monotonic() - t0
        known = [n for n in nodes if n in self.client_of_node]
        return sorted(known, key=lambda n: (self.client_of_node[n], n))

    def _record(self, round_: int) -> RoundRecord:
        return self.history.setdefault(round_, RoundRecord(round_))

    # ---- training ------------------------------------------------------------------------------
    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid) -> Iterable[Message]:
        order = self.known_order(grid)
        self._started[server_round] = time.monotonic()
        self._current = {k: v.numpy() for k, v in arrays.items()}
        self._current_hash = fingerprint(self._current, list(self.specs))
        with _seeded(self.seed, server_round, 0):
            messages = list(self.inner.configure_train(server_round, arrays, config, _OrderedGrid(grid, order)))
        rec = self._record(server_round)
        rec.sampled = len(messages)
        rec.bytes_down += sum(m.content[ARRAYS].count_bytes() for m in messages if ARRAYS in m.content.array_records)
        return messages

    def aggregate_train(self, server_round: int, replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        rec = self._record(server_round)
        accepted: list[tuple[int, Message]] = []
        updates: dict[int, EncodedDiff] = {}
        for msg in replies:
            node = msg.metadata.src_node_id
            client = self.client_of_node.get(node)
            if msg.has_error():
                self._drop(rec, client, node, f"the client failed: {msg.error.reason}")
                continue
            if ARRAYS in msg.content.array_records:
                rec.bytes_up += msg.content[ARRAYS].count_bytes()
            try:
                enc, claimed = decode_reply(msg.content)
                rec.payload_bytes_up += enc.nbytes
                diff = decode_diff(enc)
            except ModelDiffError as exc:
                self._drop(rec, client, node, str(exc))
                continue
            problems = check_update(diff.deltas, self.specs, base_hash=diff.base_hash, expected_hash=self._current_hash)
            if enc.num_examples <= 0:
                problems.append(f"claims {enc.num_examples} training examples")
            if problems:
                self._drop(rec, client if client is not None else claimed, node, "; ".join(problems))
                continue
            full = {k: (self._current[k] + diff.deltas[k]).astype(self._current[k].dtype) for k in self._current}
            # the weight Flower's strategy averages by is the count checked in decode_reply, an int in [1, 2**53]
            metrics = MetricRecord({**dict(msg.content[METRICS].items()), WEIGHT_KEY: enc.num_examples})
            msg.content = RecordDict({ARRAYS: ArrayRecord({k: Array(v) for k, v in full.items()}), METRICS: metrics})
            key = client if client is not None else claimed
            accepted.append((key, msg))
            updates[key] = enc
        accepted.sort(key=lambda pair: pair[0])
        _common_metrics(server_round, [m for _, m in accepted], "training")
        rec.clients = [c for c, _ in accepted]
        rec.participants = len(accepted)
        if len(accepted) < self.min_successful:
            rec.kept_global = True
            log.warning("round %d: %d successful update(s), fewer than the %d required (min_successful_clients); "
                        "the global model stays as it was", server_round, len(accepted), self.min_successful)
            return None, None
        with _seeded(self.seed, server_round, 1):
            new, metrics = self.inner.aggregate_train(server_round, [m for _, m in accepted])
        if new is not None:
            arrays = {k: v.numpy() for k, v in new.items()}
            bad = [k for k, v in arrays.items() if not np.all(np.isfinite(v))]
            if bad or set(arrays) != set(self.specs):
                rec.kept_global = True
                log.warning("round %d: the aggregate of %s is not finite or not the model's parameters; the global model stays as it was",
                            server_round, bad or sorted(arrays))
                return None, None
            # some strategies (median, trimmed mean) compute in float64: the model keeps its dtypes
            new = ArrayRecord({k: Array(np.ascontiguousarray(arrays[k], dtype=self.specs[k][1])) for k in self.specs})
        elif accepted:
            rec.kept_global = True
            log.warning("round %d: the strategy aggregated nothing; the global model stays as it was", server_round)
        if metrics is not None:
            rec.train_metrics = {k: float(v) for k, v in metrics.items() if not isinstance(v, list)}
        if self.keep_last_updates:
            self.last_updates = updates
        return new, metrics

    def _drop(self, rec: RoundRecord, client: int | None, node: int, reason: str) -> None:
        who = f"client {client}" if client is not None else f"node {node}"
        log.warning("round %d: %s dropped: %s", rec.round, who, reason)
        rec.dropped.append({"client": client, "node": int(node), "reason": reason})

    # ---- evaluation ----------------------------------------------------------------------------
    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid) -> Iterable[Message]:
        order = self.known_order(grid)
        with _seeded(self.seed, server_round, 2):
            messages = list(self.inner.configure_evaluate(server_round, arrays, config, _OrderedGrid(grid, order)))
        self._record(server_round).bytes_down += sum(m.content[ARRAYS].count_bytes() for m in messages if ARRAYS in m.content.array_records)
        return messages

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        rec = self._record(server_round)
        good = []
        for msg in replies:
            node = msg.metadata.src_node_id
            who = self.client_of_node.get(node, node)
            if msg.has_error():
                log.warning("round %d: evaluation on client %s failed: %s", server_round, who, msg.error.reason)
                continue
            try:
                metrics = msg.content[METRICS]
                count = check_count(metrics[WEIGHT_KEY], WEIGHT_KEY, "evaluation")
            except ModelDiffError as exc:
                log.warning("round %d: evaluation on client %s left out: %s", server_round, who, exc)
                continue
            except Exception as exc:  # no metrics record, or no count in it
                log.warning("round %d: evaluation on client %s left out: malformed reply (%s: %s)", server_round, who, type(exc).__name__, exc)
                continue
            if count == 0:  # no holdout: nothing measured (and its NaN loss would turn the weighted mean NaN)
                continue
            msg.content = RecordDict({METRICS: MetricRecord({**dict(metrics.items()), WEIGHT_KEY: count})})
            good.append((self.client_of_node.get(node, -1), msg))
        good.sort(key=lambda pair: pair[0])
        _common_metrics(server_round, [m for _, m in good], "evaluation")
        rec.client_eval_count = len(good)
        if not good:
            return None
        metrics = self.inner.aggregate_evaluate(server_round, [m for _, m in good])
        if metrics is not None:
            rec.client_eval = {k: float(v) for k, v in metrics.items() if not isinstance(v, list)}
        rec.seconds = time.monotonic() - self._started.get(server_round, time.monotonic())
        return metrics

    def summary(self) -> None:
        self.inner.summary()


def _common_metrics(server_round: int, replies: list[Message], what: str) -> None:
    """Each reply's metrics cut, in place, to the keys every reply carries as a finite number:
    Flower's strategies refuse replies whose metric keys differ (an exception that ends the
    run) and average whatever values they get (one client's NaN makes the mean NaN)."""
    if not replies:
        return

    def numeric(v) -> bool:
        return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)

    records = [m.content[METRICS] for m in replies]
    keys = [k for k in records[0] if all(k in r and numeric(r[k]) for r in records)]
    dropped = sorted({k for r in records for k in r} - set(keys))
    if dropped:
        log.warning("round %d: %s metrics %s left out of the average (not a finite number from every client)", server_round, what, dropped)
        for m, r in zip(replies, records):
            m.content[METRICS] = MetricRecord({k: r[k] for k in keys})


def build_strategy(settings: FederationSettings, specs: Mapping[str, tuple[tuple[int, ...], np.dtype]]) -> GuardedStrategy:
    """The Flower strategy ``settings.strategy`` with its options, in Flower's DP wrapper when
    ``settings.dp.enabled``, guarded (see GuardedStrategy)."""
    cls = STRATEGIES[settings.strategy]
    kwargs: dict[str, Any] = {
        "fraction_train": settings.fraction_train,
        "fraction_evaluate": settings.fraction_evaluate,
        "min_train_nodes": settings.min_train_clients,
        "min_evaluate_nodes": settings.min_evaluate_clients,
        "min_available_nodes": settings.clients,
    }
    if settings.strategy == "fedprox":
        kwargs["proximal_mu"] = settings.mu
    kwargs.update(settings.strategy_options)
    try:
        inner: fl.Strategy = cls(**kwargs)
    except TypeError as exc:
        raise ArgumentError(f"strategy {settings.strategy!r}: {exc}; its options are those of flwr.serverapp.strategy.{cls.__name__}") from None
    dp = settings.dp
    if dp.enabled:
        n = settings.sample_size()
        if dp.mode == "server_fixed":
            inner = fl.DifferentialPrivacyServerSideFixedClipping(inner, dp.noise_multiplier, dp.clipping_norm, n)
        elif dp.mode == "client_fixed":
            inner = fl.DifferentialPrivacyClientSideFixedClipping(inner, dp.noise_multiplier, dp.clipping_norm, n)
        else:
            inner = fl.DifferentialPrivacyServerSideAdaptiveClipping(inner, dp.noise_multiplier, n, initial_clipping_norm=dp.clipping_norm,
                                                                     target_clipped_quantile=dp.target_clipped_quantile,
                                                                     clip_norm_lr=dp.clip_norm_lr)
    return GuardedStrategy(inner, specs=specs, seed=settings.seed, min_successful=settings.min_successful_clients,
                           expected_clients=settings.clients, connect_timeout=settings.connect_timeout)


def ask_client_ids(grid: Grid, expected: int, timeout: float, client_of_node: dict[int, int]) -> list[int]:
    """The connected nodes' ids, once ``expected`` of them are connected (or ``timeout`` seconds
    passed); each node not in ``client_of_node`` is asked its client id (a query message) and
    added to it. A node that fails to answer is logged and left out of ``client_of_node``."""
    deadline = time.monotonic() + timeout
    nodes = list(grid.get_node_ids())
    while len(nodes) < expected and time.monotonic() < deadline:
        time.sleep(0.2)
        nodes = list(grid.get_node_ids())
    unknown = [n for n in nodes if n not in client_of_node]
    if unknown:
        asks = [Message(RecordDict({ODT: ConfigRecord({"want": "client-id"})}), dst_node_id=n, message_type=MessageType.QUERY)
                for n in unknown]
        for reply in grid.send_and_receive(asks, timeout=timeout):
            node = reply.metadata.src_node_id
            if reply.has_error():
                log.warning("node %s did not say its client id (%s); it is left out", node, reply.error.reason)
                continue
            client_of_node[node] = int(reply.content[ODT]["client-id"])
    return nodes


@dataclass
class FederationResult:
    """The final global parameters, every round's record and the last round's updates."""

    parameters: dict[str, np.ndarray]
    rounds: list[RoundRecord]
    initial_server_eval: dict[str, float]
    last_updates: dict[int, EncodedDiff]
    clients: dict[int, int]  # node id -> client id
    seconds: float
    query_seconds: float = 0.0

    def history(self) -> list[dict]:
        return [asdict(r) for r in self.rounds]


ProgressFn = Callable[[RoundRecord, FederationSettings], None]


def describe_round(rec: RoundRecord, settings: FederationSettings) -> str:
    """One line for a round that ended: clients sampled and averaged in, accuracy on the
    clients' holdouts and the server's test (where measured), bytes each way, seconds."""
    parts = [f"round {rec.round}/{settings.rounds}: {rec.participants}/{rec.sampled} clients succeeded"]
    if rec.dropped:
        parts.append(f"{len(rec.dropped)} dropped")
    if rec.kept_global:
        parts.append("global model kept")
    if "accuracy" in rec.client_eval:
        parts.append(f"clients' accuracy {rec.client_eval['accuracy']:.3f} ({rec.client_eval_count} evaluated)")
    if "accuracy" in rec.server_eval:
        parts.append(f"server's test accuracy {rec.server_eval['accuracy']:.3f}")
    parts.append(f"{rec.bytes_up:,} B up, {rec.bytes_down:,} B down, {rec.seconds:.1f} s")
    return "; ".join(parts)


def run_federation(grid: Grid, artifacts: str | os.PathLike, settings: FederationSettings, *,
                   evaluate_fn: EvaluateFn | None = None, initial: Mapping[str, np.ndarray] | None = None,
                   progress: ProgressFn | None = None, context: Context | None = None) -> FederationResult:
    """The server's side of a federation on ``grid`` (what the ServerApp's main does);
    ``progress`` gets each round's record when the round ends. With ``settings.secagg``
    enabled, Flower's SecAgg+ workflow runs the rounds (odt_ops.federated.secagg)."""
    t0 = time.monotonic()
    start = {k: np.asarray(v) for k, v in (initial or initial_parameters(artifacts)).items()}
    # The clients answer before the server computes anything (its round-0 evaluation): Flower's
    # simulation engine starts the ServerApp's thread first and Ray after it, and Ray starts its
    # processes with fork(); a fork while numpy's OpenBLAS runs a threaded product in another
    # thread takes BLAS's threads down under that product, which then waits for them forever
    # (seen in CI: the round-0 evaluation hung, and the federation with it). Once a client has
    # answered, Ray is up and forks no more.
    if settings.secagg.enabled:
        from odt_ops.federated.secagg import run_secure_federation

        client_of_node: dict[int, int] = {}
        ask_client_ids(grid, settings.clients, settings.connect_timeout, client_of_node)
        context = context or Context(run_id=0, node_id=0, node_config={}, state=RecordDict(), run_config={})
        params, rounds, initial_eval = run_secure_federation(grid, context, start, settings, evaluate_fn=evaluate_fn, progress=progress)
        return FederationResult(params, rounds, initial_eval, {}, client_of_node, time.monotonic() - t0)
    specs = {k: (tuple(v.shape), v.dtype) for k, v in start.items()}
    strategy = build_strategy(settings, specs)
    strategy.known_order(grid)  # the strategy's own first contact, timed in its query_seconds
    server_eval: dict[int, dict[str, float]] = {}

    def on_evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord | None:
        # Flower calls this last in each round (and once before round 1): the round is done
        out = evaluate_fn(server_round, {k: v.numpy() for k, v in arrays.items()}) if evaluate_fn is not None else None
        if out is not None:
            server_eval[server_round] = {k: float(v) for k, v in out.items()}
        if server_round and progress is not None:
            rec = strategy.history.setdefault(server_round, RoundRecord(server_round))
            rec.server_eval = server_eval.get(server_round, {})
            progress(rec, settings)
        return MetricRecord(server_eval[server_round]) if out is not None else None

    result = strategy.start(grid, ArrayRecord({k: Array(v) for k, v in start.items()}), num_rounds=int(settings.rounds),
                            timeout=float(settings.round_timeout), train_config=train_config(settings), evaluate_config=ConfigRecord(),
                            evaluate_fn=on_evaluate if evaluate_fn is not None or progress is not None else None)
    final = {k: v.numpy() for k, v in result.arrays.items()} if len(result.arrays) else start
    rounds = []
    for r in range(1, int(settings.rounds) + 1):
        rec = strategy.history.get(r, RoundRecord(r))
        rec.server_eval = server_eval.get(r, {})
        rounds.append(rec)
    return FederationResult(final, rounds, server_eval.get(0, {}), strategy.last_updates, dict(strategy.client_of_node),
                            time.monotonic() - t0, strategy.query_seconds)


def server_app(artifacts: str | os.PathLike, settings: FederationSettings, *, evaluate_fn: EvaluateFn | None = None,
               initial: Mapping[str, np.ndarray] | None = None, on_finish: Callable[[FederationResult], None] | None = None,
               progress: ProgressFn | None = None) -> ServerApp:
    """Flower's ServerApp for ``artifacts``. Keys of the run config (``flwr run --run-config``)
    override ``settings`` (see FederationSettings.from_config); ``on_finish`` gets the result."""
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        s = FederationSettings.from_config(dict(context.run_config), settings) if context.run_config else settings
        result = run_federation(grid, artifacts, s, evaluate_fn=evaluate_fn, initial=initial, progress=progress, context=context)
        if on_finish is not None:
            on_finish(result)

    return app
