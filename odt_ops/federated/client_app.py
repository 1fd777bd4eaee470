"""Flower's ClientApp around the engine: each SuperNode (or simulated node) trains the
global model it is sent on its own data with ``LocalTrainer`` and answers with its model
difference; it evaluates the global model on its holdout.

The repository's Flower App (``flwr run .``) uses ``pipeline.flower_app:client``; in code,
``client_app(artifacts, data)`` builds one for any artifacts and data source.
"""
from __future__ import annotations

import math
import os
from collections.abc import Callable
from pathlib import Path

from flwr.app import ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from odt_ops.federated.local import RoundConfig
from odt_ops.federated.task import (
    ARRAYS,
    CLIPPING_NORM_KEY,
    CONFIG,
    METRICS,
    ODT,
    WEIGHT_KEY,
    DataFn,
    client_id_of,
    encode_reply,
    one_thread,
    trainer,
)

Resolver = Callable[[Context], tuple[str, DataFn]]


def client_app(artifacts: str | os.PathLike, data: DataFn, *, eval_batch_size: int = 256) -> ClientApp:
    """Flower's ClientApp for ``artifacts``; ``data(client_id, context)`` gives a client's samples."""
    where = (str(Path(artifacts).resolve()), data)
    return resolved_client_app(lambda context: where, eval_batch_size=eval_batch_size)


def resolved_client_app(resolve: Resolver, *, eval_batch_size: int = 256) -> ClientApp:
    """Flower's ClientApp whose artifacts and data ``resolve(context)`` names when a message
    arrives (from the run config, for an app whose components are built at import)."""
    app = ClientApp()

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        artifacts, data = resolve(context)
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
            res = trainer(artifacts).train_round(global_params, d.x, d.y, cfg)
        metrics = {k: v for k, v in res.metrics.items() if k not in ("seconds", "train_loss_last")}
        return Message(encode_reply(res.update, res.num_examples, metrics, cid), reply_to=msg)

    @app.evaluate()
    def evaluate(msg: Message, context: Context) -> Message:
        artifacts, data = resolve(context)
        cid = client_id_of(context)
        params = {k: v.numpy() for k, v in msg.content[ARRAYS].items()}
        d = data(cid, context)
        x, y = (d.x_holdout, d.y_holdout) if d.x_holdout is not None else (d.x, d.y)
        with one_thread():
            res = trainer(artifacts).evaluate(params, x, y, batch_size=eval_batch_size)
        m = {WEIGHT_KEY: int(res.num_examples), "loss": float(res.loss)}
        if not math.isnan(res.accuracy):
            m["accuracy"] = float(res.accuracy)
        return Message(RecordDict({METRICS: MetricRecord(m)}), reply_to=msg)

    @app.query()
    def query(msg: Message, context: Context) -> Message:
        return Message(RecordDict({ODT: ConfigRecord({"client-id": client_id_of(context)})}), reply_to=msg)

    return app
