"""The repository as a Flower App: ``flwr run .`` runs these two components
(pyproject.toml's ``[tool.flwr.app.components]``) on Flower's engines, with the federate
stage's settings and data.

- ``server``: the ServerApp. Its settings are conf/federated composed as a by-hand stage
  run composes them (``pipeline.config.load``), with the run config's ``overrides`` (Hydra
  grammar: ``flwr run . --run-config "overrides='federated=fedprox federated.rounds=3'"``)
  applied: one source for the stage, the app and the Hydra group. It trains the
  artifacts ``generate`` wrote, evaluates on the global test each round, and logs one
  line per round.
- ``client``: the ClientApp. Its data is the simulated user whose id is the node's
  ``partition-id`` (Flower's simulation sets it; a SuperNode gets ``--node-config
  'partition-id=N'``), made on demand (pipeline.users).

Both find the workspace (``data/generate``, ``data/prepare``, ``conf/``) at the run config's
``workspace``, or, when it is empty, at the checkout the installed ``pipeline`` package
lives in (``pipeline.paths.project_root``; ``ODT_PROJECT_ROOT`` overrides it). The
workspace needs ``dvc repro generate`` (the README's first command does it).
"""
from __future__ import annotations

import functools
import logging
import shlex
from pathlib import Path

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from odt_ops.federated.client_app import resolved_client_app
from odt_ops.federated.server_app import describe_round, run_federation
from odt_ops.federated.task import DataFn, central_evaluation
from pipeline import config, inputs, users
from pipeline.errors import DataError
from pipeline.paths import Paths, project_root

log = logging.getLogger("flwr")  # Flower's logger: what `flwr run --stream` and `flwr log` show


@functools.lru_cache(maxsize=4)
def workspace(root: str, overrides: str):
    """(configuration, paths) of the workspace at ``root`` with ``overrides`` (cached per process:
    a simulation's worker plays many clients)."""
    base = Path(root) if root else project_root()
    cfg = config.load(shlex.split(overrides), root=base)
    paths = Paths(base)
    if not paths.artifacts.checkpoint.is_file():
        raise DataError(f"{paths.artifacts.directory}: no training artifacts; run `dvc repro generate` in {base} first")
    return cfg, paths


def _workspace_of(context: Context):
    rc = context.run_config
    return workspace(str(rc.get("workspace", "")), str(rc.get("overrides", "")))


@functools.lru_cache(maxsize=4)
def _population(root: str, overrides: str) -> DataFn:
    cfg, paths = workspace(root, overrides)
    return users.population(cfg, paths).data


def _client_resolve(context: Context) -> tuple[str, DataFn]:
    rc = context.run_config
    key = (str(rc.get("workspace", "")), str(rc.get("overrides", "")))
    _, paths = workspace(*key)
    return str(paths.artifacts.directory), _population(*key)


client = resolved_client_app(_client_resolve)
server = ServerApp()


@server.main()
def main(grid: Grid, context: Context) -> None:
    cfg, paths = _workspace_of(context)
    settings = cfg.federated.settings(cfg.seed)
    population = users.population(cfg, paths)
    test = inputs.load_split(paths, "global_test")
    gen = paths.artifacts.directory
    log.info("federation of %d clients, %d rounds, %s, artifacts %s", settings.clients, settings.rounds, settings.strategy, gen)
    result = run_federation(grid, gen, settings, evaluate_fn=central_evaluation(gen, test.x, population.targets(test.y)),
                            progress=lambda rec, s: log.info("%s", describe_round(rec, s)), context=context)
    log.info("done in %.1f s: server's test accuracy %s", result.seconds,
             f"{result.rounds[-1].server_eval.get('accuracy', float('nan')):.3f}" if result.rounds else "n/a")
