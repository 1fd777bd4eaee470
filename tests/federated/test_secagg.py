"""SecAgg+ end to end with real ClientApps: Flower's SecAggPlusWorkflow on the server and
secaggplus_mod on each client (our ClientApp, as SuperNodes and the simulation run it),
over an in-process grid that keeps each node's context between messages as a SuperNode
does. Oracles: plain FedAvg (Flower's FedAvg through the Message API, itself checked
against odt_ops.export.aggregate in test_flower.py) on the same clients, with the
protocol's documented quantization as the tolerance; and every reply the server
receives, searched for any client's update (the same search finds them in a plain run)."""
from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("flwr")

from flwr.app import Message
from flwr.common import bytes_to_ndarray

from odt_ops.federated import LocalTrainer, RoundConfig
from odt_ops.federated.flower import FederationSettings, SecAggSettings, client_app, initial_parameters, run_federation
from tests.federated.helpers import NodeGrid, mlp_artifacts
from tests.federated.test_flower import blobs

CLIENTS = 4


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    art = mlp_artifacts(tmp_path_factory.mktemp("secagg_mlp"))
    data, _ = blobs(CLIENTS)
    return art, data


def settings(**secagg):
    return FederationSettings(rounds=1, clients=CLIENTS, fraction_train=1.0, fraction_evaluate=1.0, lr=0.1, seed=5,
                              secagg=SecAggSettings(**secagg))


def client_updates(art, data, s: FederationSettings) -> dict[int, dict[str, np.ndarray]]:
    """Each client's round-1 difference, computed directly by the engine (what it would send)."""
    trainer, start = LocalTrainer(art), initial_parameters(art)
    out = {}
    for cid in range(CLIENTS):
        d = data(cid)
        res = trainer.train_round(start, d.x, d.y, RoundConfig(epochs=s.local_epochs, batch_size=s.batch_size, learning_rate=s.lr,
                                                               seed=s.seed, client_id=cid, server_round=1))
        out[cid] = {k: np.asarray(v) for k, v in res.diff.deltas.items()}
    return out


def arrays_in(reply: Message):
    """Every tensor a reply carries: its ArrayRecords' arrays and any serialized ndarray in its
    ConfigRecords (SecAgg+ sends its masked vector as bytes)."""
    if reply.has_error():
        return
    for rec in reply.content.array_records.values():
        for arr in rec.values():
            yield arr.numpy()
    for rec in reply.content.config_records.values():
        for value in rec.values():
            for item in value if isinstance(value, list) else [value]:
                if isinstance(item, bytes):
                    try:
                        yield bytes_to_ndarray(item)
                    except Exception:  # keys, shares, ciphertexts: not arrays
                        continue


def revealed(replies, updates) -> set[int]:
    """Clients one of whose update tensors a reply carries, as it is or under any affine map
    (SecAgg+'s weighting, shift and quantization are affine): |correlation| > 0.995, which
    random vectors of 10 or more values reach with a probability below 1e-8."""
    found = set()
    for reply in replies:
        for arr in arrays_in(reply):
            a = np.asarray(arr, np.float64).ravel()
            for cid, deltas in updates.items():
                for d in deltas.values():
                    d = d.astype(np.float64).ravel()
                    if a.size == d.size and a.std() > 0 and abs(np.corrcoef(a, d)[0, 1]) > 0.995:
                        found.add(cid)
    return found


def test_secagg_aggregate_is_fedavg_within_quantization_and_no_update_is_seen(setup):
    art, data = setup
    plain_grid = NodeGrid(client_app(art, data), CLIENTS)
    plain = run_federation(plain_grid, art, settings())
    s = settings(enabled=True, num_shares=3, reconstruction_threshold=2, clipping_range=1.0)
    grid = NodeGrid(client_app(art, data), CLIENTS)
    secure = run_federation(grid, art, s)
    updates = client_updates(art, data, s)

    # the clients' updates fit the clipping range, so only quantization separates the two
    assert max(float(np.abs(d).max()) for u in updates.values() for d in u.values()) < s.secagg.clipping_range
    # documented error: each client's weighted vector is stochastically rounded to steps of 2c/Q
    # (error < one step), the unmasked sum divided by the clients' weights n_i / max_weight
    step = 2 * s.secagg.clipping_range / s.secagg.quantization_range
    weights = sum(len(data(c).y) / s.secagg.max_weight for c in range(CLIENTS))
    tolerance = CLIENTS * step / weights + 1e-6
    start = initial_parameters(art)
    moved = max(float(np.abs(plain.parameters[k] - start[k]).max()) for k in start)
    assert moved > 1000 * tolerance  # the round changed the model far beyond the tolerance
    for k in start:
        np.testing.assert_allclose(secure.parameters[k], plain.parameters[k], rtol=0, atol=tolerance, err_msg=k)
    assert secure.rounds[0].participants == CLIENTS
    assert secure.rounds[0].client_eval_count == CLIENTS

    # the server saw every client's update in the plain run (the search works) and none under SecAgg+
    assert revealed(plain_grid.replies, updates) == set(range(CLIENTS))
    assert revealed(grid.replies, updates) == set()
    # secaggplus_mod emptied the reply's arrays before it left the client
    assert all(len(rec) == 0 for r in grid.replies if not r.has_error() for rec in r.content.array_records.values())


def test_a_client_with_more_examples_than_max_weight_weighs_max_weight(setup):
    """secaggplus_mod multiplies an update by num_examples / max_weight before clipping it to the
    clipping range, and above 1 only warns (flwr/client/mod/secure_aggregation/secaggplus_mod.py):
    our client caps its count at max_weight, so every client here (40 examples, max_weight 20)
    weighs 20, no update is scaled past the range, and the result is the plain FedAvg of these
    equal-count clients within quantization. Uncapped, each update was doubled and clipped."""
    art, data = setup
    plain = run_federation(NodeGrid(client_app(art, data), CLIENTS), art, settings())
    updates = client_updates(art, data, settings())
    largest = max(float(np.abs(d).max()) for u in updates.values() for d in u.values())
    s = settings(enabled=True, num_shares=3, reconstruction_threshold=2, clipping_range=1.05 * largest, max_weight=20.0)
    assert all(len(data(c).y) > s.secagg.max_weight for c in range(CLIENTS))
    secure = run_federation(NodeGrid(client_app(art, data), CLIENTS), art, s)
    step = 2 * s.secagg.clipping_range / s.secagg.quantization_range
    tolerance = CLIENTS * step / CLIENTS + 1e-6  # each client's weight is max_weight / max_weight = 1
    start = initial_parameters(art)
    assert max(float(np.abs(plain.parameters[k] - start[k]).max()) for k in start) > 1000 * tolerance
    for k in start:
        np.testing.assert_allclose(secure.parameters[k], plain.parameters[k], rtol=0, atol=tolerance, err_msg=k)
