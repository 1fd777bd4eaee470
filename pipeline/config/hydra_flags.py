"""Hydra's own command-line flags on a stage (``python -m pipeline.train --cfg job``).

The stages load their configuration through Hydra's compose API (pipeline/config/load.py),
not ``@hydra.main``, so Hydra's flags would reach the override parser as overrides. A stage
hands them to Hydra's real entry point instead, over the same primary config ``load`` uses
(``params.yaml`` plus the overrides, or ``conf/``), so what Hydra prints is what the stage
would run:

- ``--cfg job|hydra|all`` (``-c``), with ``--resolve`` and ``--package``/``-p``: the composed
  configuration as YAML;
- ``--info [all|config|defaults|defaults-tree|plugins|searchpath]`` (``-i``): Hydra's report;
- ``--hydra-help``: Hydra's help; ``--version``: Hydra's version.

``-m``/``--multirun`` (and a sweep such as ``optimizer.lr=1e-3,3e-3``) is refused with the
command that sweeps: every run of a stage writes the same ``data/<stage>/``, so a sweep is
a set of DVC experiments, each in its own copy (``dvc exp run --queue``).
"""
from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

from pipeline.errors import ConfigError

# Hydra's entry point's flags (hydra/_internal/utils.py, get_args_parser): those taking a value, with
# the values allowed where Hydra restricts them (None: any), and the bare switches
CFG = ("job", "hydra", "all")
INFO = ("all", "config", "defaults", "defaults-tree", "plugins", "searchpath")
VALUED = {"--cfg": CFG, "-c": CFG, "--info": INFO, "-i": INFO, "--package": None, "-p": None}
SWITCHES = ("--hydra-help", "--version", "--resolve")
SHOW = ("--cfg", "-c", "--info", "-i", "--hydra-help", "--version")  # print and exit
MULTIRUN = ("-m", "--multirun")


def wants_hydra(args: Sequence[str]) -> bool:
    """True when ``args`` hold one of Hydra's show-and-exit flags."""
    return any(a.split("=", 1)[0] in SHOW for a in args)


def is_multirun(args: Sequence[str]) -> bool:
    return any(a in MULTIRUN for a in args)


def split(args: Sequence[str]) -> tuple[list[str], list[str]]:
    """(Hydra's flags with their values, the overrides)."""
    flags: list[str] = []
    overrides: list[str] = []
    i = 0
    while i < len(args):
        arg = args[i]
        name = arg.split("=", 1)[0]
        if name in SWITCHES:
            flags.append(arg)
        elif name in VALUED:
            flags.append(arg)
            choices = VALUED[name]
            following = args[i + 1] if i + 1 < len(args) else None
            if "=" not in arg and following is not None and (choices is None or following in choices):
                flags.append(following)  # --cfg job, --info defaults, -p optimizer
                i += 1
        else:
            overrides.append(arg)
        i += 1
    return flags, overrides


def sweep_error(stage: str, overrides: Sequence[str]) -> ConfigError:
    """How to sweep, for ``-m`` or a sweep override on a stage."""
    sets = " ".join(f"-S '{o}'" for o in overrides if not o.startswith("-")) or "-S 'optimizer.lr=1e-3,3e-3'"
    return ConfigError(f"a stage runs one configuration (its outputs are data/{stage}/): sweep as DVC experiments, each in its "
                       f"own copy: dvc exp run --queue {sets} && dvc queue start (then dvc exp show)")


def run_hydra(stage: str, args: Sequence[str], *, root: Path | None = None) -> int:
    """Hydra's entry point over the stage's primary config, for ``--cfg``/``--info``/``--hydra-help``.
    The overrides are checked first (a bad one is our one-line ConfigError, exit 2)."""
    import hydra

    from pipeline.config.load import CONFIG_NAME, load, read_params, register_params_primary
    from pipeline.paths import project_root

    root = Path(root) if root is not None else project_root()
    flags, overrides = split(args)
    load(overrides, root=root)  # raises ConfigError naming the key
    params = root / "params.yaml"
    name = register_params_primary(read_params(params), overrides, root) if params.is_file() else CONFIG_NAME

    def task(cfg) -> None:  # never called: each flag here shows and exits
        raise AssertionError("Hydra ran the task for a show-only flag")

    argv = sys.argv
    sys.argv = [f"python -m pipeline.{stage}", *overrides, *flags]  # flags last: a bare --info takes no override as its value
    try:
        hydra.main(config_path=str(root / "conf"), config_name=name, version_base=None)(task)()
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 1
    finally:
        sys.argv = argv
    return 0


def sweeps(overrides: Sequence[str]) -> list[str]:
    """The overrides that sweep (``key=a,b``, ``range()``, ``choice()``); a parse error is left to ``load``."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    try:
        parsed = OverridesParser.create().parse_overrides(list(overrides))
    except HydraException:
        return []
    return [o.input_line or "" for o in parsed if o.is_sweep_override()]
