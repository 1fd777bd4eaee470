"""The task: what a Flower client and server do with the engine, apart from Flower's apps.

Flower's layout (``client_app``, ``server_app``, ``task``): here are one client's data
(``ClientData``), the engine's trainer per process, the records a reply carries (the
encoded model difference in ``arrays``, the example count and metrics in ``metrics``, the
base hash and encoding in ``odt``), the round's training settings as clients receive
them, and the server-side evaluation of the global model.
"""
from __future__ import annotations

import contextlib
import math
import os
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")  # read when flwr is imported; the network is not ours to use

from flwr.app import Array, ArrayRecord, ConfigRecord, Context, MetricRecord, RecordDict

from odt_ops.errors import ModelDiffError
from odt_ops.export import check_count
from odt_ops.federated.encoding import EncodedDiff
from odt_ops.federated.local import EvalResult, LocalTrainer
from odt_ops.federated.settings import FederationSettings

ARRAYS, METRICS, CONFIG, ODT = "arrays", "metrics", "config", "odt"
SCALE_SUFFIX = "::scale"
CLIENT_ID = "partition-id"  # Flower's node_config key: simulation sets it, SuperNodes get it with --node-config
WEIGHT_KEY = "num-examples"
CLIPPING_NORM_KEY = "clipping_norm"  # flwr's KEY_CLIPPING_NORM: what the client-side DP wrapper sends


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


def trainer(artifacts: str | os.PathLike) -> LocalTrainer:
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
        num_examples = check_count(metrics[WEIGHT_KEY], WEIGHT_KEY, "update")  # a forged weight: refused, not averaged
        num_steps = check_count(info.get("num-steps", 0), "num-steps", "update")
        enc = EncodedDiff(encoding, tensors, str(info["base-hash"]), scales, num_examples, num_steps)
        return enc, int(info["client-id"])
    except ModelDiffError:
        raise
    except Exception as exc:  # a reply without our records, or with records of the wrong kind
        raise ModelDiffError(f"malformed update ({type(exc).__name__}: {exc})") from None


def train_config(settings: FederationSettings) -> ConfigRecord:
    """What every client's round is told (FedProx adds ``proximal-mu`` itself)."""
    return ConfigRecord({"local-epochs": int(settings.local_epochs), "batch-size": int(settings.batch_size),
                         "learning-rate": float(settings.lr), "proximal-mu": float(settings.mu),
                         "encoding": settings.encoding, "seed": int(settings.seed)})


EvaluateFn = Callable[[int, dict[str, np.ndarray]], Mapping[str, float] | None]


def central_evaluation(artifacts: str | os.PathLike, x: np.ndarray, y: np.ndarray, *, batch_size: int = 256) -> EvaluateFn:
    """A server-side evaluation of the global model on (x, y): loss and accuracy."""

    def evaluate(server_round: int, params: dict[str, np.ndarray]) -> dict[str, float]:
        res: EvalResult = trainer(artifacts).evaluate(params, x, y, batch_size=batch_size)
        out = {"loss": res.loss}
        if not math.isnan(res.accuracy):
            out["accuracy"] = res.accuracy
        return out

    return evaluate


def initial_parameters(artifacts: str | os.PathLike) -> dict[str, np.ndarray]:
    """The artifacts' trainable parameters: round 1's global model."""
    return {k: v.copy() for k, v in trainer(artifacts).base.items()}

