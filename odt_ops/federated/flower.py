"""Flower around the engine, in one import: the names of ``client_app``, ``server_app``,
``task``, ``settings`` and ``simulation`` (Flower's layout; the modules say what each does).

A user writes only where each client's data comes from::

    def data(client_id: int, context) -> ClientData:
        x, y = load_my_users_data(client_id)
        return ClientData(x, y, x_holdout, y_holdout)

    settings = FederationSettings(strategy="fedavg", rounds=5, fraction_train=0.5, clients=100)
    result = simulate("artifacts/", data, settings)                     # Flower's Ray backend
    # or, deployed: client_app("artifacts/", data) on each SuperNode and
    # server_app("artifacts/", settings) on the SuperLink (README, "Federated learning")
"""
from odt_ops.federated.client_app import client_app
from odt_ops.federated.server_app import (
    STRATEGIES,
    FederationResult,
    GuardedStrategy,
    RoundRecord,
    build_strategy,
    describe_round,
    run_federation,
    server_app,
)
from odt_ops.federated.settings import DP_MODES, DPSettings, FederationSettings, SecAggSettings
from odt_ops.federated.simulation import simulate
from odt_ops.federated.task import ClientData, central_evaluation, decode_reply, encode_reply, initial_parameters, train_config

__all__ = ["DP_MODES", "STRATEGIES", "ClientData", "DPSettings", "FederationResult", "FederationSettings", "GuardedStrategy",
           "RoundRecord", "SecAggSettings", "build_strategy", "central_evaluation", "client_app", "decode_reply", "describe_round",
           "encode_reply", "initial_parameters", "run_federation", "server_app", "simulate", "train_config"]
