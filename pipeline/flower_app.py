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

A user's error (a bad override, missing artifacts: ``ConfigError``, ``DataError``, any
``PipelineError`` or ``OdtError``) ends the ServerApp as it ends ``python -m
pipeline.federate``: one line, ``federate: error: <what and the fix>``, in Flower's log
(what ``flwr run --stream`` and ``flwr log`` show), no traceback. The error is then raised
on to Flower, whose runtime records the run as failed (``flwr ls``: ``finished:failed``,
the error in its details; exit code 700 in simulation, 201 on a SuperLink); raising is a
ServerApp's only way to fail a run in Flower 1.42. Flower logs a ServerApp's exception
with its traceback; ``_reported`` drops that traceback for the error the line already
told. Any other exception is a bug and keeps its traceback.
"""
from __future__ import annotations

import functools
import logging
import shlex
import weakref
from pathlib import Path

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from odt_ops.errors import OdtError
from odt_ops.federated.client_app import resolved_client_app
from odt_ops.federated.server_app import describe_round, run_federation
from odt_ops.federated.task import DataFn, central_evaluation
from pipeline import config, inputs, users
from pipeline.errors import DataError, PipelineError
from pipeline.paths import Paths, project_root

log = logging.getLogger("flwr")  # Flower's logger: what `flwr run --stream` and `flwr log` show
STAGE = "federate"  # the stage whose settings the app runs: its errors read as `python -m pipeline.federate`'s


class _ReportedErrors(logging.Filter):
    """Drops the traceback from Flower's log record of an error the ServerApp has reported as
    one line (Flower's runtime logs the exception a ServerApp raises with ``exc_info``:
    flwr/simulation/app.py, flwr/superlink/runtime/run_serverapp.py); every other record,
    and every other exception's traceback, passes unchanged."""

    def __init__(self) -> None:
        super().__init__()
        self.errors: weakref.WeakSet[BaseException] = weakref.WeakSet()

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and record.exc_info[1] in self.errors:
            record.exc_info = record.exc_text = None
        return True


_reported = _ReportedErrors()


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
    try:
        _federate(grid, context)
    except (PipelineError, OdtError) as exc:
        log.error("%s: error: %s", STAGE, exc)
        _reported.errors.add(exc)
        log.addFilter(_reported)  # once: a filter already there is not added again
        raise  # Flower's runtime marks the run failed


def _federate(grid: Grid, context: Context) -> None:
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
