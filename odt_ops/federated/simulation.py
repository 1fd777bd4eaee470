"""Flower's simulation engine (Ray) for the apps of ``client_app`` and ``server_app``."""
from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator, Mapping

import numpy as np

from odt_ops.federated.client_app import client_app
from odt_ops.federated.server_app import FederationResult, ProgressFn, server_app
from odt_ops.federated.settings import FederationSettings
from odt_ops.federated.task import DataFn, EvaluateFn


def simulate(artifacts: str | os.PathLike, data: DataFn, settings: FederationSettings, *, evaluate_fn: EvaluateFn | None = None,
             initial: Mapping[str, np.ndarray] | None = None, num_cpus: int | None = None, verbose: bool = False,
             progress: ProgressFn | None = None) -> FederationResult:
    """Run a federation of ``settings.clients`` simulated clients on Flower's simulation
    engine (``flwr.simulation.run_simulation``, Ray backend), each client one CPU and one
    BLAS thread; the result as the server saw it."""
    from flwr.simulation import run_simulation

    box: dict[str, FederationResult] = {}
    server = server_app(artifacts, settings, evaluate_fn=evaluate_fn, initial=initial, on_finish=lambda r: box.setdefault("result", r),
                        progress=progress)
    client = client_app(artifacts, data)
    backend_config = {"client_resources": {"num_cpus": 1, "num_gpus": 0.0}, "init_args": ray_init_args(num_cpus, verbose)}
    with quiet_flower(verbose), single_threaded_workers():
        run_simulation(server_app=server, client_app=client, num_supernodes=int(settings.clients), backend_config=backend_config)
    if "result" not in box:
        raise RuntimeError("the Flower simulation ended without a result (see the log above)")
    return box["result"]


def ray_init_args(num_cpus: int | None = None, verbose: bool = False) -> dict:
    """``ray.init``'s options for a simulation on this machine: as many actors (one client
    each at a time) as ``num_cpus``, no dashboard (Flower's default too), the workers' logs
    kept off the terminal unless verbose, and an object store sized for model
    parameters (Ray's default reserves 30% of memory): its shared memory is set up at
    start, so a small one starts sooner and leaves the memory to the clients."""
    cpus = int(num_cpus or os.cpu_count() or 1)
    return {"num_cpus": cpus, "num_gpus": 0, "include_dashboard": False, "logging_level": "ERROR", "log_to_driver": bool(verbose),
            "object_store_memory": OBJECT_STORE_BYTES}


OBJECT_STORE_BYTES = 128 * 2**20  # Ray's minimum is 75 MiB; a round's messages are kilobytes to megabytes


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


