"""Flower around the engine: a ClientApp and a ServerApp built from training artifacts.

The one module of odt_ops that imports Flower (``pip install 'odt[federated]'``, which
pins ``flwr[simulation]``); it uses Flower's Message API (``ClientApp`` with
``@app.train()``/``@app.evaluate()``/``@app.query()``, ``ServerApp``, ``ArrayRecord``,
``MetricRecord``, ``ConfigRecord``) and Flower's own strategies. A user writes only
where each client's data comes from::

    def data(client_id: int, context) -> ClientData:
        x, y = load_my_users_data(client_id)
        return ClientData(x, y, x_holdout, y_holdout)

    settings = FederationSettings(strategy="fedavg", rounds=5, fraction_train=0.5)
    result = simulate("artifacts/", data, settings, num_clients=100)      # Flower's Ray backend
    # or, deployed: client_app("artifacts/", data) on each SuperNode and
    # server_app("artifacts/", settings) on the SuperLink (see deployment_app)

What travels: the server sends the global trainable parameters (an ``ArrayRecord``,
float32) and the round's training settings (a ``ConfigRecord``); a client trains with
``LocalTrainer`` and answers with its model difference in the configured encoding
(``arrays``: one tensor per parameter, ``<name>::scale`` for int8), its example count and
metrics (``metrics``) and the base hash and encoding (``odt``).

``GuardedStrategy`` sits between Flower's loop and the chosen Flower strategy (FedAvg,
FedProx, FedAdam, FedAvgM, FedMedian, Krum, ..., optionally inside one of Flower's
differential-privacy wrappers). It

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
  round. The same seed gives the same global model bits.
"""
from __future__ import annotations

import contextlib
import logging
import math
import os
import random
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import numpy as np

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")  # read when flwr is imported; the network is not ours to use

from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MessageType, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp import strategy as fl

from odt_ops.errors import ArgumentError, ModelDiffError
from odt_ops.federated.encoding import ENCODINGS, EncodedDiff, check_update, decode_diff, fingerprint
from odt_ops.federated.local import EvalResult, LocalTrainer, RoundConfig

log = logging.getLogger("odt_ops.federated")

ARRAYS, METRICS, CONFIG, ODT = "arrays", "metrics", "config", "odt"
SCALE_SUFFIX = "::scale"
CLIENT_ID = "partition-id"  # Flower's node_config key: simulation sets it, SuperNodes get it with --node-config
WEIGHT_KEY = "num-examples"
CLIPPING_NORM_KEY = "clipping_norm"  # flwr's KEY_CLIPPING_NORM: what the client-side DP wrapper sends

# Flower strategies by name, with the constructor options each takes beyond the sampling ones
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
DP_MODES = ("server_fixed", "server_adaptive", "client_fixed")


# ---------------------------------------------------------------------------------- settings


@dataclass
class DPSettings:
    """Flower's central differential privacy: a wrapper around the strategy that clips each
    update's L2 norm (on the server, or on the client for ``client_fixed``) and adds
    Gaussian noise of ``noise_multiplier * clipping_norm / sampled clients`` to the average."""

    enabled: bool = False
    mode: str = "server_fixed"  # server_fixed | server_adaptive | client_fixed
    noise_multiplier: float = 0.1
    clipping_norm: float = 1.0  # the fixed norm, or the adaptive one's start
    target_clipped_quantile: float = 0.5  # server_adaptive only
    clip_norm_lr: float = 0.2  # server_adaptive only


@dataclass
class FederationSettings:
    """A federation: the Flower strategy and its options, rounds, sampling, the clients'
    local training, the update's encoding, differential privacy and the seed."""

    strategy: str = "fedavg"
    strategy_options: dict[str, Any] = field(default_factory=dict)  # passed to the Flower strategy (eta, server_momentum, ...)
    rounds: int = 3
    num_clients: int = 2  # how many SuperNodes to expect (simulation: how many it starts)
    fraction_train: float = 1.0
    fraction_evaluate: float = 1.0
    min_train_clients: int = 1
    min_evaluate_clients: int = 1
    min_successful_clients: int = 1  # fewer surviving updates: the round keeps the global model
    local_epochs: int = 1
    batch_size: int = 16
    learning_rate: float = 0.05
    proximal_mu: float = 0.0
    encoding: str = "float32"
    dp: DPSettings = field(default_factory=DPSettings)
    seed: int = 0
    round_timeout: float = 600.0
    connect_timeout: float = 120.0  # waiting for num_clients SuperNodes to connect

    def __post_init__(self):
        if isinstance(self.dp, Mapping):
            self.dp = DPSettings(**self.dp)
        problems = []
        if self.strategy not in STRATEGIES:
            problems.append(f"strategy={self.strategy!r} (one of {', '.join(STRATEGIES)})")
        if self.encoding not in ENCODINGS:
            problems.append(f"encoding={self.encoding!r} (one of {', '.join(ENCODINGS)})")
        if self.dp.mode not in DP_MODES:
            problems.append(f"dp.mode={self.dp.mode!r} (one of {', '.join(DP_MODES)})")
        for name in ("rounds", "num_clients", "local_epochs", "batch_size", "min_train_clients", "min_evaluate_clients", "min_successful_clients"):
            if int(getattr(self, name)) < (0 if name == "rounds" else 1):
                problems.append(f"{name}={getattr(self, name)} (too small)")
        for name in ("fraction_train", "fraction_evaluate"):
            if not 0.0 <= float(getattr(self, name)) <= 1.0:
                problems.append(f"{name}={getattr(self, name)} (expected in [0, 1])")
        if problems:
            raise ArgumentError("federation settings: " + "; ".join(problems))

    def sample_size(self) -> int:
        """Clients sampled per training round (Flower's rule: max(fraction * N, minimum))."""
        return min(self.num_clients, max(int(self.num_clients * self.fraction_train), self.min_train_clients))

    def to_config(self) -> dict[str, Any]:
        """A flat dict (``dp.noise_multiplier`` ...) for logs and run configs."""
        flat = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("dp", "strategy_options")}
        flat.update({f"dp.{k}": v for k, v in asdict(self.dp).items()})
        flat.update({f"strategy_options.{k}": v for k, v in self.strategy_options.items()})
        return flat

    @classmethod
    def from_config(cls, flat: Mapping[str, Any], base: "FederationSettings | None" = None) -> "FederationSettings":
        """``base`` with the keys of a flat dict (as ``to_config`` writes, or a Flower run config) applied."""
        base = base or cls()
        top = {k: v for k, v in flat.items() if "." not in k and k in {f.name for f in fields(cls)} - {"dp", "strategy_options"}}
        dp = {k.split(".", 1)[1]: v for k, v in flat.items() if k.startswith("dp.")}
        opts = {k.split(".", 1)[1]: v for k, v in flat.items() if k.startswith("strategy_options.")}
        return replace(base, **top, dp=replace(base.dp, **dp), strategy_options={**base.strategy_options, **opts})


# ---------------------------------------------------------------------------------- the client


@dataclass
class ClientData:
    """One client's samples: ``y`` as the artifacts' label input takes them (class ids for
    cross-entropy). The holdout, when given, is what federated evaluation measures."""

    x: np.ndarray
    y: np.ndarray
    x_holdout: np.ndarray | None = None
    y_holdout: np.ndarray | None = None


DataFn = Callable[[int, Context], ClientData]

_trainers: dict[str, LocalTrainer] = {}
_trainers_lock = threading.Lock()


def _trainer(artifacts: str | os.PathLike) -> LocalTrainer:
    """One LocalTrainer per artifacts directory and process (a Ray actor plays many clients in turn)."""
    key = str(Path(artifacts).resolve())
    with _trainers_lock:
        if key not in _trainers:
            _trainers[key] = LocalTrainer(key)
        return _trainers[key]


def client_id_of(context: Context) -> int:
    """The client's id: ``partition-id`` from the node config (Flower's simulation sets it;
    start a SuperNode with ``--node-config 'partition-id=3'``), else the node id."""
    value = context.node_config.get(CLIENT_ID)
    return int(value) if value is not None else int(context.node_id)


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """At most one BLAS thread (threadpoolctl when installed): a client is one device."""
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        yield
        return
    with threadpool_limits(limits=1):
        yield


def encode_reply(enc: EncodedDiff, num_examples: int, metrics: Mapping[str, float], client_id: int) -> RecordDict:
    """The reply's records: the encoded difference, the weight and metrics, the base hash."""
    arrays = {name: Array(np.ascontiguousarray(t)) for name, t in enc.tensors.items()}
    arrays.update({f"{name}{SCALE_SUFFIX}": Array(np.array(s, np.float32)) for name, s in enc.scales.items()})
    m = MetricRecord({WEIGHT_KEY: int(num_examples), **{k: float(v) for k, v in metrics.items() if k != WEIGHT_KEY}})
    info = ConfigRecord({"base-hash": enc.base_hash, "encoding": enc.encoding, "client-id": int(client_id), "num-steps": int(enc.num_steps)})
    return RecordDict({ARRAYS: ArrayRecord(arrays), METRICS: m, ODT: info})


def decode_reply(content: RecordDict) -> tuple[EncodedDiff, int]:
    """(the encoded difference, the client id) from a reply's records; ModelDiffError if malformed."""
    try:
        info = content[ODT]
        arrays = content[ARRAYS]
        metrics = content[METRICS]
        encoding = str(info["encoding"])
        tensors, scales = {}, {}
        for key, value in arrays.items():
            if key.endswith(SCALE_SUFFIX):
                scales[key[: -len(SCALE_SUFFIX)]] = float(value.numpy())
            else:
                tensors[key] = value.numpy()
        enc = EncodedDiff(encoding, tensors, str(info["base-hash"]), scales, int(metrics[WEIGHT_KEY]), int(info.get("num-steps", 0)))
        return enc, int(info["client-id"])
    except ModelDiffError:
        raise
    except Exception as exc:  # a reply without our records, or with records of the wrong kind
        raise ModelDiffError(f"malformed update ({type(exc).__name__}: {exc})") from None


def client_app(artifacts: str | os.PathLike, data: DataFn, *, eval_batch_size: int = 256) -> ClientApp:
    """Flower's ClientApp for ``artifacts``; ``data(client_id, context)`` gives a client's samples."""
    app = ClientApp()
    artifacts = str(Path(artifacts).resolve())

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        cid = client_id_of(context)
        config = msg.content[CONFIG]
        global_params = {k: v.numpy() for k, v in msg.content[ARRAYS].items()}
        d = data(cid, context)
        clip = config.get(CLIPPING_NORM_KEY)
        cfg = RoundConfig(
            epochs=int(config["local-epochs"]), batch_size=int(config["batch-size"]), learning_rate=float(config["learning-rate"]),
            proximal_mu=float(config.get("proximal-mu", 0.0)), seed=int(config["seed"]), client_id=cid,
            server_round=int(config["server-round"]), encoding=str(config["encoding"]),
            clip_norm=float(clip) if clip is not None else None,
        )
        with one_thread():
            res = _trainer(artifacts).train_round(global_params, d.x, d.y, cfg)
        metrics = {k: v for k, v in res.metrics.items() if k not in ("seconds", "train_loss_last")}
        return Message(encode_reply(res.update, res.num_examples, metrics, cid), reply_to=msg)

    @app.evaluate()
    def evaluate(msg: Message, context: Context) -> Message:
        cid = client_id_of(context)
        params = {k: v.numpy() for k, v in msg.content[ARRAYS].items()}
        d = data(cid, context)
        x, y = (d.x_holdout, d.y_holdout) if d.x_holdout is not None else (d.x, d.y)
        with one_thread():
            res = _trainer(artifacts).evaluate(params, x, y, batch_size=eval_batch_size)
        m = {WEIGHT_KEY: int(res.num_examples), "loss": float(res.loss)}
        if not math.isnan(res.accuracy):
            m["accuracy"] = float(res.accuracy)
        return Message(RecordDict({METRICS: MetricRecord(m)}), reply_to=msg)

    @app.query()
    def query(msg: Message, context: Context) -> Message:
        return Message(RecordDict({ODT: ConfigRecord({"client-id": client_id_of(context)})}), reply_to=msg)

    return app


# ---------------------------------------------------------------------------------- the server


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


@dataclass
class RoundRecord:
    """What happened in one round, as the server saw it."""

    round: int
    sampled: int = 0
    participants: int = 0  # updates averaged in
    dropped: list[dict] = field(default_factory=list)  # {client, node, reason}
    kept_global: bool = False  # too few successful clients: the global model stayed
    bytes_down: int = 0  # ArrayRecord bytes sent (train and evaluate messages)
    bytes_up: int = 0  # ArrayRecord bytes received from clients
    payload_bytes_up: int = 0  # encoded values (and int8 scales) only
    train_metrics: dict[str, float] = field(default_factory=dict)
    client_eval: dict[str, float] = field(default_factory=dict)  # weighted over the clients' holdouts
    client_eval_count: int = 0
    server_eval: dict[str, float] = field(default_factory=dict)
    seconds: float = 0.0
    clients: list[int] = field(default_factory=list)  # the clients averaged in


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
    def _known_order(self, grid: Grid) -> list[int]:
        """Every connected node's id, ordered by client id (asking new nodes theirs once)."""
        deadline = time.monotonic() + self.connect_timeout
        nodes = list(grid.get_node_ids())
        while len(nodes) < self.expected_clients and time.monotonic() < deadline:
            time.sleep(0.2)
            nodes = list(grid.get_node_ids())
        unknown = [n for n in nodes if n not in self.client_of_node]
        if unknown:
            t0 = time.monotonic()
            asks = [Message(RecordDict({ODT: ConfigRecord({"want": "client-id"})}), dst_node_id=n, message_type=MessageType.QUERY)
                    for n in unknown]
            for reply in grid.send_and_receive(asks, timeout=self.connect_timeout):
                node = reply.metadata.src_node_id
                if reply.has_error():
                    log.warning("node %s did not say its client id (%s); it is left out", node, reply.error.reason)
                    continue
                self.client_of_node[node] = int(reply.content[ODT]["client-id"])
            self.query_seconds += time.monotonic() - t0
        known = [n for n in nodes if n in self.client_of_node]
        return sorted(known, key=lambda n: (self.client_of_node[n], n))

    def _record(self, round_: int) -> RoundRecord:
        return self.history.setdefault(round_, RoundRecord(round_))

    # ---- training ------------------------------------------------------------------------------
    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid) -> Iterable[Message]:
        order = self._known_order(grid)
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
            metrics = MetricRecord({k: v for k, v in msg.content[METRICS].items()})
            msg.content = RecordDict({ARRAYS: ArrayRecord({k: Array(v) for k, v in full.items()}), METRICS: metrics})
            key = client if client is not None else claimed
            accepted.append((key, msg))
            updates[key] = enc
        accepted.sort(key=lambda pair: pair[0])
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
        order = self._known_order(grid)
        with _seeded(self.seed, server_round, 2):
            messages = list(self.inner.configure_evaluate(server_round, arrays, config, _OrderedGrid(grid, order)))
        self._record(server_round).bytes_down += sum(m.content[ARRAYS].count_bytes() for m in messages if ARRAYS in m.content.array_records)
        return messages

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        rec = self._record(server_round)
        good = []
        for msg in replies:
            node = msg.metadata.src_node_id
            if msg.has_error():
                log.warning("round %d: evaluation on client %s failed: %s", server_round, self.client_of_node.get(node, node), msg.error.reason)
                continue
            good.append((self.client_of_node.get(node, -1), msg))
        good.sort(key=lambda pair: pair[0])
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


def build_strategy(settings: FederationSettings, specs: Mapping[str, tuple[tuple[int, ...], np.dtype]]) -> GuardedStrategy:
    """The Flower strategy ``settings.strategy`` with its options, in Flower's DP wrapper when
    ``settings.dp.enabled``, guarded (see GuardedStrategy)."""
    cls = STRATEGIES[settings.strategy]
    kwargs: dict[str, Any] = {
        "fraction_train": settings.fraction_train,
        "fraction_evaluate": settings.fraction_evaluate,
        "min_train_nodes": settings.min_train_clients,
        "min_evaluate_nodes": settings.min_evaluate_clients,
        "min_available_nodes": settings.num_clients,
    }
    if settings.strategy == "fedprox":
        kwargs["proximal_mu"] = settings.proximal_mu
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
                           expected_clients=settings.num_clients, connect_timeout=settings.connect_timeout)


def train_config(settings: FederationSettings) -> ConfigRecord:
    """What every client's round is told (FedProx adds ``proximal-mu`` itself)."""
    return ConfigRecord({"local-epochs": int(settings.local_epochs), "batch-size": int(settings.batch_size),
                         "learning-rate": float(settings.learning_rate), "proximal-mu": float(settings.proximal_mu),
                         "encoding": settings.encoding, "seed": int(settings.seed)})


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


EvaluateFn = Callable[[int, dict[str, np.ndarray]], Mapping[str, float] | None]


def central_evaluation(artifacts: str | os.PathLike, x: np.ndarray, y: np.ndarray, *, batch_size: int = 256) -> EvaluateFn:
    """A server-side evaluation of the global model on (x, y): loss and accuracy."""

    def evaluate(server_round: int, params: dict[str, np.ndarray]) -> dict[str, float]:
        res: EvalResult = _trainer(artifacts).evaluate(params, x, y, batch_size=batch_size)
        out = {"loss": res.loss}
        if not math.isnan(res.accuracy):
            out["accuracy"] = res.accuracy
        return out

    return evaluate


def initial_parameters(artifacts: str | os.PathLike) -> dict[str, np.ndarray]:
    """The artifacts' trainable parameters: round 1's global model."""
    return {k: v.copy() for k, v in _trainer(artifacts).base.items()}


def run_federation(grid: Grid, artifacts: str | os.PathLike, settings: FederationSettings, *,
                   evaluate_fn: EvaluateFn | None = None, initial: Mapping[str, np.ndarray] | None = None) -> FederationResult:
    """The server's side of a federation on ``grid`` (what the ServerApp's main does)."""
    t0 = time.monotonic()
    start = {k: np.asarray(v) for k, v in (initial or initial_parameters(artifacts)).items()}
    specs = {k: (tuple(v.shape), v.dtype) for k, v in start.items()}
    strategy = build_strategy(settings, specs)
    server_eval: dict[int, dict[str, float]] = {}

    def on_evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord | None:
        if evaluate_fn is None:
            return None
        out = evaluate_fn(server_round, {k: v.numpy() for k, v in arrays.items()})
        if out is None:
            return None
        server_eval[server_round] = {k: float(v) for k, v in out.items()}
        return MetricRecord(server_eval[server_round])

    result = strategy.start(grid, ArrayRecord({k: Array(v) for k, v in start.items()}), num_rounds=int(settings.rounds),
                            timeout=float(settings.round_timeout), train_config=train_config(settings), evaluate_config=ConfigRecord(),
                            evaluate_fn=on_evaluate if evaluate_fn is not None else None)
    final = {k: v.numpy() for k, v in result.arrays.items()} if len(result.arrays) else start
    rounds = []
    for r in range(1, int(settings.rounds) + 1):
        rec = strategy.history.get(r, RoundRecord(r))
        rec.server_eval = server_eval.get(r, {})
        rounds.append(rec)
    return FederationResult(final, rounds, server_eval.get(0, {}), strategy.last_updates, dict(strategy.client_of_node),
                            time.monotonic() - t0, strategy.query_seconds)


def server_app(artifacts: str | os.PathLike, settings: FederationSettings, *, evaluate_fn: EvaluateFn | None = None,
               initial: Mapping[str, np.ndarray] | None = None,
               on_finish: Callable[[FederationResult], None] | None = None) -> ServerApp:
    """Flower's ServerApp for ``artifacts``. Keys of the run config (``flwr run --run-config``)
    override ``settings`` (see FederationSettings.from_config); ``on_finish`` gets the result."""
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        s = FederationSettings.from_config(dict(context.run_config), settings) if context.run_config else settings
        result = run_federation(grid, artifacts, s, evaluate_fn=evaluate_fn, initial=initial)
        if on_finish is not None:
            on_finish(result)

    return app


# ---------------------------------------------------------------------------------- simulation


def simulate(artifacts: str | os.PathLike, data: DataFn, settings: FederationSettings, *, evaluate_fn: EvaluateFn | None = None,
             initial: Mapping[str, np.ndarray] | None = None, num_cpus: int | None = None, verbose: bool = False) -> FederationResult:
    """Run a federation of ``settings.num_clients`` simulated clients on Flower's simulation
    engine (``flwr.simulation.run_simulation``, Ray backend), each client one CPU and one
    BLAS thread; the result as the server saw it."""
    from flwr.simulation import run_simulation

    box: dict[str, FederationResult] = {}
    server = server_app(artifacts, settings, evaluate_fn=evaluate_fn, initial=initial, on_finish=lambda r: box.setdefault("result", r))
    client = client_app(artifacts, data)
    cpus = int(num_cpus or os.cpu_count() or 1)
    backend_config = {"client_resources": {"num_cpus": 1, "num_gpus": 0.0},
                      "init_args": {"num_cpus": cpus, "num_gpus": 0, "logging_level": "ERROR", "log_to_driver": bool(verbose)}}
    with quiet_flower(verbose), single_threaded_workers():
        run_simulation(server_app=server, client_app=client, num_supernodes=int(settings.num_clients), backend_config=backend_config)
    if "result" not in box:
        raise RuntimeError("the Flower simulation ended without a result (see the log above)")
    return box["result"]


@contextlib.contextmanager
def single_threaded_workers() -> Iterator[None]:
    """Environment for the Ray workers the simulation starts: one BLAS/OpenMP thread each, no
    usage statistics, Flower's telemetry off (the network is not ours to use)."""
    wanted = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "RAY_USAGE_STATS_ENABLED": "0",
              "FLWR_TELEMETRY_ENABLED": "0", "RAY_DEDUP_LOGS": "0", "RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO": "0"}
    saved = {k: os.environ.get(k) for k in wanted}
    os.environ.update(wanted)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def quiet_flower(verbose: bool = False) -> Iterator[None]:
    """Flower logs every step at INFO (and that run_simulation is deprecated in favour of its
    CLI at WARNING); keep its errors only, unless verbose."""
    logger = logging.getLogger("flwr")
    level = logger.level
    if not verbose:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


__all__ = ["ClientData", "DPSettings", "FederationResult", "FederationSettings", "GuardedStrategy", "RoundRecord", "STRATEGIES",
           "build_strategy", "central_evaluation", "client_app", "decode_reply", "encode_reply", "initial_parameters", "run_federation",
           "server_app", "simulate", "train_config"]
