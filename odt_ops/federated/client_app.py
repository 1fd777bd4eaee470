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

import numpy as np
from flwr.app import ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from odt_ops.federated import secagg
from odt_ops.federated.local import RoundConfig, RoundResult
from odt_ops.federated.secagg import secagg_when_asked
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
    arrives (from the run config, for an app whose components are built at import).

    It answers both of Flower's message forms: the Message API's (``arrays`` and
    ``config`` records, what ``server_app`` sends) and, for SecAgg+, the legacy
    ``fitins``/``evaluateins`` records Flower's ``SecAggPlusWorkflow`` sends, through
    ``secaggplus_mod`` (which masks the reply's update before it leaves the device)."""
    app = ClientApp(mods=[secagg_when_asked])

    def train_round(context: Context, global_params: dict[str, np.ndarray], config) -> tuple[int, RoundResult]:
        artifacts, data = resolve(context)
        cid = client_id_of(context)
        d = data(cid, context)
        clip = config.get(CLIPPING_NORM_KEY)
        cfg = RoundConfig(
            epochs=int(config["local-epochs"]), batch_size=int(config["batch-size"]), learning_rate=float(config["learning-rate"]),
            proximal_mu=float(config.get("proximal-mu", 0.0)), seed=int(config["seed"]), client_id=cid,
            server_round=int(config["server-round"]), encoding=str(config["encoding"]),
            clip_norm=float(clip) if clip is not None else None,
        )
        with one_thread():
            return cid, trainer(artifacts).train_round(global_params, d.x, d.y, cfg)

    def evaluate_on_holdout(context: Context, params: dict[str, np.ndarray]) -> dict[str, float]:
        artifacts, data = resolve(context)
        d = data(client_id_of(context), context)
        x, y = (d.x_holdout, d.y_holdout) if d.x_holdout is not None else (d.x, d.y)
        with one_thread():
            res = trainer(artifacts).evaluate(params, x, y, batch_size=eval_batch_size)
        m = {WEIGHT_KEY: int(res.num_examples), "loss": float(res.loss)}
        if not math.isnan(res.accuracy):
            m["accuracy"] = float(res.accuracy)
        return m

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        if secagg.is_legacy_train(msg):
            params, config = secagg.read_fitins(msg, names=list(trainer(resolve(context)[0]).base))
            _, res = train_round(context, params, config)
            return Message(secagg.fitres(res, float(config[secagg.MAX_WEIGHT_KEY])), reply_to=msg)
        global_params = {k: v.numpy() for k, v in msg.content[ARRAYS].items()}
        cid, res = train_round(context, global_params, msg.content[CONFIG])
        metrics = {k: v for k, v in res.metrics.items() if k not in ("seconds", "train_loss_last")}
        return Message(encode_reply(res.update, res.num_examples, metrics, cid), reply_to=msg)

    @app.evaluate()
    def evaluate(msg: Message, context: Context) -> Message:
        if secagg.is_legacy_evaluate(msg):
            params = secagg.read_evaluateins(msg, names=list(trainer(resolve(context)[0]).base))
            return Message(secagg.evaluateres(evaluate_on_holdout(context, params)), reply_to=msg)
        params = {k: v.numpy() for k, v in msg.content[ARRAYS].items()}
        return Message(RecordDict({METRICS: MetricRecord(evaluate_on_holdout(context, params))}), reply_to=msg)

    @app.query()
    def query(msg: Message, context: Context) -> Message:
        return Message(RecordDict({ODT: ConfigRecord({"client-id": client_id_of(context)})}), reply_to=msg)

    return app
