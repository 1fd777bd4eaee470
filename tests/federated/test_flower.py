"""The Flower adapter without Ray: Flower's own strategies and loop on an in-process grid that
delivers each message to a ClientApp, as a SuperLink would. Aggregation equals Flower's FedAvg,
bad clients are dropped with their reason, a round without enough updates keeps the model."""
from __future__ import annotations

import logging

import numpy as np
import pytest

pytest.importorskip("flwr")

from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Error, Message, MessageType, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp.strategy import FedAvg

from odt_ops.export import ModelDiff, aggregate
from odt_ops.federated import decode_diff, encode_diff, fingerprint
from odt_ops.federated.flower import (
    STRATEGIES,
    ClientData,
    DPSettings,
    FederationSettings,
    SecAggSettings,
    build_strategy,
    central_evaluation,
    client_app,
    encode_reply,
    run_federation,
)
from tests.federated.helpers import NodeGrid, mlp_artifacts


class LocalGrid:
    """Flower's Grid surface over ClientApps called in this process (node id -> (client id, app))."""

    def __init__(self, apps: dict[int, tuple[int, ClientApp]]):
        self.apps = apps
        self.sent: list[Message] = []

    def get_node_ids(self):
        return list(self.apps)[::-1]  # not in client order: the guard must order them itself

    def send_and_receive(self, messages, *, timeout=None):
        replies = []
        for msg in messages:
            self.sent.append(msg)
            cid, app = self.apps[msg.metadata.dst_node_id]
            ctx = Context(run_id=1, node_id=msg.metadata.dst_node_id, node_config={"partition-id": cid}, state=RecordDict(), run_config={})
            try:
                replies.append(app(msg, ctx))
            except Exception as exc:  # what a SuperNode reports when its ClientApp raises
                replies.append(Message(Error(code=1, reason=f"{type(exc).__name__}: {exc}"), reply_to=msg))
        return replies[::-1]  # arrival order is not client order either


def blobs(n_clients=6, seed=0):
    """Per client a skewed mix of ten noisy prototypes (8x8): learnable, non-iid."""
    centers = np.random.default_rng(123).random((10, 1, 8, 8), dtype=np.float32)

    def data(cid, context=None):
        rng = np.random.default_rng([seed, cid])
        p = rng.dirichlet(np.full(10, 0.5))
        y = rng.choice(10, 60, p=p)
        x = (centers[y] + 0.3 * rng.standard_normal((60, 1, 8, 8))).astype(np.float32)
        return ClientData(x[:40], y[:40], x[40:], y[40:])

    rng = np.random.default_rng([seed, 999])
    yt = rng.integers(0, 10, 300)
    xt = (centers[yt] + 0.3 * rng.standard_normal((300, 1, 8, 8))).astype(np.float32)
    return data, (xt, yt)


@pytest.fixture(autouse=True, scope="module")
def task_identity():
    """What the SuperLink (or run_simulation) sets before a ServerApp creates messages."""
    from flwr.common.constant import SUPERLINK_NODE_ID
    from flwr.supercore.task_identity import TaskIdentity

    TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, 1, SUPERLINK_NODE_ID


@pytest.fixture(scope="module")
def art(tmp_path_factory):
    return mlp_artifacts(tmp_path_factory.mktemp("fl_mlp"))


def grid_for(art, data, n, *, wrap=None):
    app = client_app(art, data)
    return LocalGrid({1000 + 17 * i: (i, wrap(i, app) if wrap else app) for i in range(n)})


def test_aggregate_equals_flowers_fedavg():
    """odt_ops.export.aggregate over differences == Flower's FedAvg over the trained weights."""
    rng = np.random.default_rng(0)
    base = {"w": rng.standard_normal((16, 8)).astype(np.float32), "b": rng.standard_normal(16).astype(np.float32)}
    counts = [40, 7, 113, 1]
    diffs = [ModelDiff({k: (rng.standard_normal(v.shape) * 0.05).astype(np.float32) for k, v in base.items()}, fingerprint(base), n)
             for n in counts]
    ours = aggregate(diffs)
    assert ours.num_examples == sum(counts)
    instr = Message(RecordDict(), dst_node_id=1, message_type=MessageType.TRAIN)
    replies = [Message(RecordDict({"arrays": ArrayRecord({k: Array(base[k] + d.deltas[k]) for k in base}),
                                   "metrics": MetricRecord({"num-examples": d.num_examples})}), reply_to=instr) for d in diffs]
    theirs, _ = FedAvg().aggregate_train(1, replies)
    for k in base:
        np.testing.assert_allclose(base[k] + ours.deltas[k], theirs[k].numpy(), rtol=1e-6, atol=1e-6)
    # and on the differences themselves (Flower accumulates in float32, we in float64: float32 rounding apart)
    replies = [Message(RecordDict({"arrays": ArrayRecord({k: Array(d.deltas[k]) for k in base}),
                                   "metrics": MetricRecord({"num-examples": d.num_examples})}), reply_to=instr) for d in diffs]
    theirs, _ = FedAvg().aggregate_train(1, replies)
    for k in base:
        np.testing.assert_allclose(ours.deltas[k], theirs[k].numpy(), rtol=1e-5, atol=1e-8)
    # explicit weights too
    w = [1.0, 2.0, 0.5, 3.0]
    replies = [Message(RecordDict({"arrays": ArrayRecord({k: Array(d.deltas[k]) for k in base}),
                                   "metrics": MetricRecord({"num-examples": wi})}), reply_to=instr) for d, wi in zip(diffs, w)]
    theirs, _ = FedAvg().aggregate_train(1, replies)
    for k in base:
        np.testing.assert_allclose(aggregate(diffs, w).deltas[k], theirs[k].numpy(), rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize("encoding", ["float32", "float16", "int8"])
def test_a_federation_learns_and_its_bytes_are_counted(art, encoding):
    data, (xt, yt) = blobs()
    s = FederationSettings(rounds=3, clients=6, fraction_train=0.5, lr=0.1, local_epochs=2, encoding=encoding, seed=3)
    grid = grid_for(art, data, 6)
    res = run_federation(grid, art, s, evaluate_fn=central_evaluation(art, xt, yt))
    accs = [res.initial_server_eval["accuracy"]] + [r.server_eval["accuracy"] for r in res.rounds]
    assert accs[-1] > accs[0] + 0.1, accs
    n_values = 64 * 32 + 32 + 32 * 10 + 10
    per_value = {"float32": 4, "float16": 2, "int8": 1}[encoding]
    for r in res.rounds:
        assert r.sampled == 3
        assert r.participants == 3
        assert not r.dropped
        assert not r.kept_global
        assert r.payload_bytes_up == 3 * (n_values * per_value + (16 if encoding == "int8" else 0))
        assert r.bytes_up > r.payload_bytes_up  # plus .npy headers and keys
        assert r.bytes_down >= 9 * n_values * 4  # global model to 3 trainers and 6 evaluators
        assert r.client_eval_count == 6
        assert 0 <= r.client_eval["accuracy"] <= 1
    assert sorted(res.clients.values()) == list(range(6))
    assert len(res.last_updates) == 3
    assert all(u.encoding == encoding for u in res.last_updates.values())


def test_same_seed_same_bits_other_seed_other_clients(art):
    data, _ = blobs()
    s = FederationSettings(rounds=2, clients=6, fraction_train=0.5, lr=0.1, seed=11)
    a = run_federation(grid_for(art, data, 6), art, s)
    b = run_federation(grid_for(art, data, 6), art, s)
    assert [r.clients for r in a.rounds] == [r.clients for r in b.rounds]
    for k in a.parameters:
        assert a.parameters[k].tobytes() == b.parameters[k].tobytes()
    c = run_federation(grid_for(art, data, 6), art, FederationSettings(rounds=2, clients=6, fraction_train=0.5, lr=0.1, seed=12))
    assert [r.clients for r in a.rounds] != [r.clients for r in c.rounds]


FORGED_WEIGHTS = {"weight-1e308": 1e308, "weight-2**62": 2**62, "weight-float": 40.0, "weight-0": 0, "weight-negative": -5}


def _misbehaving(kind_by_client):
    """Wrap client apps so some misbehave: fail, send NaN, train from another base, send garbage."""

    def wrap(cid, app):
        kind = kind_by_client.get(cid)
        if kind is None:
            return app
        bad = ClientApp()

        @bad.train()
        def train(msg, ctx):
            if kind == "fail":
                raise RuntimeError("the battery died")
            reply = app(msg, ctx)
            if kind == "nan":
                key = next(iter(reply.content["arrays"].keys()))
                arr = reply.content["arrays"][key].numpy().copy()
                arr.flat[0] = np.nan
                reply.content["arrays"][key] = Array(arr)
            elif kind == "stale":
                reply.content["odt"]["base-hash"] = "0" * 64
            elif kind == "shape":
                key = next(iter(reply.content["arrays"].keys()))
                reply.content["arrays"][key] = Array(np.zeros(3, np.float32))
            elif kind == "garbage":
                reply.content = RecordDict({"arrays": ArrayRecord(), "metrics": MetricRecord({"num-examples": 5})})
            elif kind in FORGED_WEIGHTS:  # an honest update, a forged weight
                reply.content["metrics"]["num-examples"] = FORGED_WEIGHTS[kind]
            elif kind == "extra-metric":
                reply.content["metrics"]["forged"] = 1.0
            elif kind == "nan-metric":
                reply.content["metrics"]["train_loss"] = float("nan")
            return reply

        @bad.evaluate()
        def evaluate(msg, ctx):
            if kind == "eval-fail":
                raise RuntimeError("no holdout today")
            reply = app(msg, ctx)
            if kind in ("eval-heavy", "eval-extra", "eval-empty"):
                m = reply.content["metrics"]
                if kind == "eval-heavy":
                    m["num-examples"] = 1e308
                elif kind == "eval-extra":
                    m["forged"] = 1.0
                else:  # a client with no holdout examples: no count, a NaN loss
                    m["num-examples"], m["loss"] = 0, float("nan")
            return reply

        @bad.query()
        def query(msg, ctx):
            return app(msg, ctx)

        return bad

    return wrap


def test_bad_clients_are_dropped_with_their_reason(art, caplog):
    data, _ = blobs()
    kinds = {1: "fail", 2: "nan", 3: "stale", 4: "shape", 5: "garbage"}
    s = FederationSettings(rounds=1, clients=7, lr=0.1, seed=0)
    with caplog.at_level(logging.WARNING, logger="odt_ops.federated"):
        res = run_federation(grid_for(art, data, 7, wrap=_misbehaving(kinds)), art, s)
    r = res.rounds[0]
    assert r.clients == [0, 6]
    assert r.participants == 2
    assert not r.kept_global
    reasons = {d["client"]: d["reason"] for d in r.dropped}
    assert set(reasons) == set(kinds)
    assert "battery died" in reasons[1]
    assert "NaN or infinite" in reasons[2]
    assert "another base" in reasons[3]
    assert "expected float32" in reasons[4]
    assert "malformed" in reasons[5]
    assert all(f"client {c} dropped" in caplog.text for c in kinds)
    # what was averaged is the two good clients' FedAvg, exactly as Flower's FedAvg does it
    good = run_federation(grid_for(art, data, 7, wrap=lambda cid, app: app), art,
                          FederationSettings(rounds=1, clients=7, lr=0.1, seed=0))
    assert good.rounds[0].clients == list(range(7))


def test_too_few_successful_clients_keep_the_global_model(art, caplog):
    data, _ = blobs()
    kinds = {0: "fail", 1: "nan", 2: "stale"}
    s = FederationSettings(rounds=2, clients=4, lr=0.1, min_successful_clients=2, seed=0)
    with caplog.at_level(logging.WARNING, logger="odt_ops.federated"):
        res = run_federation(grid_for(art, data, 4, wrap=_misbehaving(kinds)), art, s)
    assert [r.kept_global for r in res.rounds] == [True, True]
    assert [r.participants for r in res.rounds] == [1, 1]
    from odt_ops.federated.flower import initial_parameters

    start = initial_parameters(art)
    for k in start:
        np.testing.assert_array_equal(res.parameters[k], start[k])
    assert "fewer than the 2 required" in caplog.text
    assert "stays as it was" in caplog.text


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_every_flower_strategy_by_name(art, name):
    data, (xt, yt) = blobs()
    options = {"fedadam": {"eta": 0.01, "eta_l": 0.01}, "fedyogi": {"eta": 0.01, "eta_l": 0.01}, "fedadagrad": {"eta": 0.01, "eta_l": 0.01},
               "fedavgm": {"server_momentum": 0.5}, "krum": {"num_malicious_nodes": 1}, "multikrum": {"num_malicious_nodes": 1, "num_nodes_to_select": 3},
               "bulyan": {"num_malicious_nodes": 1}, "fedtrimmedavg": {"beta": 0.2}}.get(name, {})
    s = FederationSettings(strategy=name, strategy_options=options, rounds=2, clients=7, lr=0.1, mu=0.1 if name == "fedprox" else 0.0)
    guard = build_strategy(s, {"w": ((2,), np.dtype(np.float32))})
    assert type(guard.inner).__name__.lower() == name
    grid = grid_for(art, data, 7)
    res = run_federation(grid, art, s, evaluate_fn=central_evaluation(art, xt, yt))
    assert all(r.participants == 7 and not r.kept_global for r in res.rounds)
    assert res.rounds[-1].server_eval["accuracy"] > res.initial_server_eval["accuracy"]
    if name == "fedprox":  # Flower's FedProx sends mu; our clients add the proximal term
        trains = [m for m in grid.sent if m.metadata.message_type == MessageType.TRAIN]
        assert trains
        assert all(m.content["config"]["proximal-mu"] == 0.1 for m in trains)
        assert res.rounds[0].train_metrics["proximal_term"] > 0


@pytest.mark.parametrize("mode", ["server_fixed", "server_adaptive", "client_fixed"])
def test_differential_privacy_wrappers(art, mode):
    data, (xt, yt) = blobs()
    s = FederationSettings(rounds=2, clients=6, lr=0.1, seed=4, dp=DPSettings(enabled=True, mode=mode, noise_multiplier=0.01, clipping_norm=0.5))
    guard = build_strategy(s, {"w": ((2,), np.dtype(np.float32))})
    assert "DifferentialPrivacy" in type(guard.inner).__name__
    a = run_federation(grid_for(art, data, 6), art, s, evaluate_fn=central_evaluation(art, xt, yt))
    b = run_federation(grid_for(art, data, 6), art, s)
    for k in a.parameters:  # the noise is seeded: same bits
        assert a.parameters[k].tobytes() == b.parameters[k].tobytes()
    if mode != "server_adaptive":
        # every update was clipped to 0.5, so the mean moved by at most 0.5 (+ noise)
        from odt_ops.federated.flower import initial_parameters

        start = initial_parameters(art)
        step = np.sqrt(sum(float(np.sum((a.parameters[k].astype(np.float64) - start[k]) ** 2)) for k in start))
        assert step < 2 * 0.5 + 0.5
    if mode == "client_fixed":
        assert a.rounds[0].train_metrics["update_norm"] <= 0.5 + 1e-6  # clipped on the clients (a weighted mean of norms <= 0.5)


def test_settings_from_a_flat_run_config():
    s = FederationSettings.from_config({"rounds": 7, "dp.enabled": True, "strategy_options.eta": 0.5, "encoding": "int8"})
    assert s.rounds == 7
    assert s.dp.enabled
    assert s.strategy_options == {"eta": 0.5}
    assert s.encoding == "int8"
    assert FederationSettings.from_config(s.to_config()) == s
    with pytest.raises(ValueError, match="strategy='fedsgd'"):
        FederationSettings(strategy="fedsgd")
    for seed in (-1, 1.5, "3", None, True):  # each client's RoundConfig would refuse it, every round
        with pytest.raises(ValueError, match="seed"):
            FederationSettings(seed=seed)


def test_encode_reply_round_trip():
    from odt_ops.federated.flower import decode_reply

    d = ModelDiff({"w": np.linspace(-1, 1, 10, dtype=np.float32)}, "h" * 64, 12, 3)
    enc = encode_diff(d, "int8")
    back, cid = decode_reply(encode_reply(enc, 12, {"train_loss": 0.5}, 4))
    assert cid == 4
    assert back.encoding == "int8"
    assert back.scales == enc.scales
    assert back.num_examples == 12
    np.testing.assert_array_equal(back.tensors["w"], enc.tensors["w"])
    assert isinstance(ConfigRecord, type)


@pytest.mark.parametrize("secure", [False, True], ids=["flower-strategy", "secagg"])
def test_every_client_answers_before_the_server_computes(art, secure):
    """run_federation asks each client its id before its round-0 evaluation. Under Flower's
    simulation engine that is the moment Ray has finished starting its processes: Ray forks
    them from another thread, and a fork during one of numpy's threaded OpenBLAS products hangs
    that product for good (why: run_federation)."""
    events: list[tuple[str, object]] = []

    class RecordingGrid(NodeGrid):
        def send_and_receive(self, messages, *, timeout=None):
            messages = list(messages)
            events.extend(("send", m.metadata.message_type) for m in messages)
            return super().send_and_receive(messages, timeout=timeout)

    data, (xt, yt) = blobs(4)
    central = central_evaluation(art, xt, yt)

    def evaluate(server_round, params):
        events.append(("evaluate", server_round))
        return central(server_round, params)

    s = FederationSettings(rounds=1, clients=4, fraction_train=1.0, fraction_evaluate=1.0, lr=0.1, seed=5, secagg=SecAggSettings(enabled=secure))
    res = run_federation(RecordingGrid(client_app(art, data), 4), art, s, evaluate_fn=evaluate)
    assert events[:5] == [("send", MessageType.QUERY)] * 4 + [("evaluate", 0)]
    assert ("evaluate", 1) in events  # and the federation ran on
    assert sorted(res.clients.values()) == [0, 1, 2, 3]


def _replies(diffs, weights):
    instr = Message(RecordDict(), dst_node_id=1, message_type=MessageType.TRAIN)
    return [Message(RecordDict({"arrays": ArrayRecord({k: Array(v) for k, v in d.items()}), "metrics": MetricRecord({"num-examples": w})}),
                    reply_to=instr) for d, w in zip(diffs, weights)]


def test_what_flowers_fedavg_does_with_a_forged_weight():
    """The oracle for what the guard stops: Flower's FedAvg sums the claimed weights as they come
    (flwr/serverapp/strategy/strategy_utils.py, aggregate_arrayrecords) and checks only that the key is there and not
    a list (validate_message_reply_consistency)."""
    arrays = [{"w": np.full(3, v, np.float32)} for v in (1.0, 2.0, 3.0)]
    theirs, _ = FedAvg().aggregate_train(1, _replies(arrays, [1e308, 1e308, 5]))
    np.testing.assert_array_equal(theirs["w"].numpy(), np.zeros(3, np.float32))  # the weights' sum is inf: every factor 0
    theirs, _ = FedAvg().aggregate_train(1, _replies(arrays, [2**62, 40, 5]))
    np.testing.assert_allclose(theirs["w"].numpy(), arrays[0]["w"], rtol=1e-6)  # a huge legal int: that client's model, alone
    with np.errstate(invalid="ignore"):
        theirs, _ = FedAvg().aggregate_train(1, _replies(arrays, [float("nan"), 40, 5]))
    assert np.all(np.isnan(theirs["w"].numpy()))


@pytest.mark.parametrize("value", [1e308, 2**62, 2**53 + 1, 40.0, -5, "40", float("nan"), float("inf")], ids=repr)
def test_decode_reply_refuses_a_forged_weight(value):
    from odt_ops.errors import ModelDiffError
    from odt_ops.federated.flower import decode_reply

    content = encode_reply(encode_diff(ModelDiff({"w": np.ones(3, np.float32)}, "h" * 64, 12, 3)), 12, {}, 4)
    if isinstance(value, str):  # a MetricRecord holds no strings: a record of another kind under the key
        content["metrics"] = ConfigRecord({"num-examples": value})
    else:
        content["metrics"]["num-examples"] = value
    with pytest.raises(ModelDiffError, match="num-examples|malformed"):
        decode_reply(content)


def _fedavg_by_hand(start, updates):
    """The round's global model computed here in float64 from the updates the server kept."""
    diffs = {c: decode_diff(u) for c, u in updates.items()}
    total = sum(d.num_examples for d in diffs.values())
    return {k: start[k].astype(np.float64) + sum(d.num_examples * d.deltas[k].astype(np.float64) for d in diffs.values()) / total
            for k in start}


def test_forged_weights_are_dropped_and_the_rest_averaged_correctly(art, caplog):
    from odt_ops.federated.flower import initial_parameters

    data, _ = blobs()
    kinds = {1: "weight-1e308", 2: "weight-1e308", 3: "weight-2**62", 4: "weight-float", 5: "weight-0", 6: "weight-negative",
             7: "extra-metric", 8: "nan-metric"}
    s = FederationSettings(rounds=1, clients=10, lr=0.1, seed=0)
    with caplog.at_level(logging.WARNING, logger="odt_ops.federated"):
        res = run_federation(grid_for(art, data, 10, wrap=_misbehaving(kinds)), art, s)
    r = res.rounds[0]
    assert r.clients == [0, 7, 8, 9]  # before: 1e308 twice made Flower's weights sum to inf and the global model all zeros
    reasons = {d["client"]: d["reason"] for d in r.dropped}
    assert set(reasons) == {1, 2, 3, 4, 5, 6}
    assert "update: num-examples is 1e+308 (float); expected a whole number" in reasons[1]
    assert "num-examples is 4611686018427387904, outside [0, 2**53]" in reasons[3]
    assert "num-examples is 40.0 (float)" in reasons[4]
    assert "claims 0 training examples" in reasons[5]
    assert "num-examples is -5" in reasons[6]
    # an extra or NaN metric no longer ends the run (Flower raised InconsistentMessageReplies) nor poisons the mean
    assert "training metrics ['forged', 'train_loss'] left out of the average" in caplog.text
    assert "train_loss" not in r.train_metrics and "forged" not in r.train_metrics
    expected = _fedavg_by_hand(initial_parameters(art), res.last_updates)
    assert sorted(res.last_updates) == [0, 7, 8, 9]
    for k, v in expected.items():
        np.testing.assert_allclose(res.parameters[k], v, rtol=1e-5, atol=1e-6)
    # and exactly what Flower gives when those clients fail outright
    failed = run_federation(grid_for(art, data, 10, wrap=_misbehaving(dict.fromkeys(range(1, 7), "fail"))), art, s)
    for k in res.parameters:
        assert res.parameters[k].tobytes() == failed.parameters[k].tobytes()


def test_forged_evaluation_weights_are_left_out(art, caplog):
    data, _ = blobs()
    s = FederationSettings(rounds=1, clients=6, lr=0.1, seed=0)
    with caplog.at_level(logging.WARNING, logger="odt_ops.federated"):
        forged = run_federation(grid_for(art, data, 6, wrap=_misbehaving({1: "eval-heavy", 2: "eval-heavy", 3: "eval-empty"})), art, s)
    honest = run_federation(grid_for(art, data, 6, wrap=_misbehaving({1: "eval-fail", 2: "eval-fail", 3: "eval-fail"})), art, s)
    # before: 1e308 twice summed to inf and the clients' accuracy and loss came out 0.0; a NaN loss with 0 examples made the loss NaN
    assert forged.rounds[0].client_eval == honest.rounds[0].client_eval
    assert forged.rounds[0].client_eval_count == honest.rounds[0].client_eval_count == 3
    assert 0 < forged.rounds[0].client_eval["accuracy"] <= 1 and np.isfinite(forged.rounds[0].client_eval["loss"])
    assert "evaluation on client 1 left out: evaluation: num-examples is 1e+308 (float)" in caplog.text
    extra = run_federation(grid_for(art, data, 6, wrap=_misbehaving({4: "eval-extra"})), art, s)
    assert extra.rounds[0].client_eval_count == 6 and "forged" not in extra.rounds[0].client_eval
