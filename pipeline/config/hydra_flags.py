"""Hydra's own command-line flags on a stage (``python -m pipeline.train --cfg job``).

The stages load their configuration through Hydra's compose API (pipeline/config/load.py),
not ``@hydra.main``, so Hydra's flags would reach the override parser as overrides.
``dispatch`` takes them out first, read by Hydra's own argument parser (its flags, their
values and its argparse errors: ``--cfg bogus`` is ``argument --cfg/-c: invalid choice:
'bogus' (choose from 'job', 'hydra', 'all')``), applies Hydra's rules (one of --run,
--multirun, --cfg, --info and --shell-completion; --resolve only with --cfg), and then,
flag by flag, every flag ``--hydra-help`` lists:

- ``--cfg job|hydra|all`` (``-c``), with ``--resolve`` and ``--package``/``-p``: the composed
  configuration as YAML; ``--info [all|config|defaults|defaults-tree|plugins|searchpath]``
  (``-i``): Hydra's report; ``--hydra-help``: Hydra's help; ``--version``: Hydra's version.
  These run Hydra's real entry point over the same primary config ``load`` uses
  (``params.yaml`` plus the overrides, or ``conf/``), so what Hydra prints is what the stage
  would run. Hydra composes its help with no primary config, so ``--hydra-help`` gets only
  the ``hydra`` overrides (Hydra itself fails on a group switch there).
- ``--run``/``-r``: the default mode; the stage runs. ``--package``/``-p`` without ``--cfg``:
  Hydra ignores it and runs; so does the stage, saying so in one line.
- ``--shell-completion``/``-sc install=bash|uninstall=bash`` (``=zsh``: the same script, as
  Hydra gives zsh, for ``bashcompinit``): a script completing ``python -m pipeline.<stage>``
  with Hydra's own completions (``query=bash``, which the script calls, runs Hydra's
  completion plugin over the stage's primary config). Hydra's scripts complete ``python
  <file.py>`` (they look for ``@hydra.main`` in it) or an installed command, never ``python
  -m <module>``, so the script is this module's. Fish's is refused: its registration is just
  as bound to a file.
- ``-m``/``--multirun`` (and a sweep such as ``optimizer.lr=1e-3,3e-3``) is refused with the
  command that sweeps: every run of a stage writes the same ``data/<stage>/``, so a sweep is
  a set of DVC experiments, each in its own copy (``dvc exp run --queue``).
- ``--config-name``/``-cn``, ``--config-path``/``-cp``, ``--config-dir``/``-cd``: refused. A
  stage's primary config is ``params.yaml``, the file DVC tracks and runs, composed from
  ``conf/``; another primary config or search path would run a configuration DVC knows
  nothing of. The line names what does the job: overrides, a conf group option.
- ``--experimental-rerun``: refused; a stage keeps no Hydra job pickle, DVC reruns it.

An unknown flag is argparse's "unrecognized arguments". Every refusal and bad value is a
``ConfigError``: one line, exit 2.
"""
from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

from pipeline.errors import ConfigError

COMPLETION_COMMANDS = ("install", "uninstall", "query")  # Hydra's (hydra/_internal/hydra.py, shell_completion)
COMPLETION_FUNCTION = "_odt_stage_completion"
# The shell script ``-sc install=bash`` prints. The query runs the very command being completed
# (its interpreter, ``-m`` and its module), so the completions are that checkout's conf/.
# '=' is taken out of COMP_WORDBREAKS, as Hydra's script does, so key=value is one word.
INSTALL_SCRIPT = """\
# completion of Hydra overrides for `python -m pipeline.<stage>` (from `python -m pipeline.{stage} -sc install=bash`)
if [ -z "${{_ODT_OLD_COMP+set}}" ]; then
    _ODT_OLD_COMP=$(complete -p {names} 2> /dev/null) || true  # none: nothing to restore
fi
{function}()
{{
    local words=($COMP_LINE)
    if [ "${{words[1]}}" == "-m" ] && [[ "${{words[2]}}" == pipeline.* ]] && (( COMP_CWORD > 2 )); then
        local choices
        choices=$(COMP_POINT=$COMP_POINT COMP_LINE=$COMP_LINE "${{words[0]}}" -m "${{words[2]}}" -sc query=bash 2> /dev/null)
        COMPREPLY=($(compgen -o nospace -o default -W "$choices" -- "${{words[$COMP_CWORD]}}"))
    fi
}}
COMP_WORDBREAKS=${{COMP_WORDBREAKS//=}}
complete -o nospace -o default -F {function} {names}
"""
UNINSTALL_SCRIPT = """\
complete -r {names} 2> /dev/null
eval "${{_ODT_OLD_COMP:-}}"
unset -f {function}
unset _ODT_OLD_COMP
"""


def parser() -> argparse.ArgumentParser:
    """Hydra's entry point's argument parser (hydra/_internal/utils.py, get_args_parser), its
    errors raised as ConfigError instead of printing its usage and exiting."""
    from hydra._internal.utils import get_args_parser

    def refuse(message: str) -> NoReturn:  # argparse's message names the flag and, for a bad value, the allowed ones
        hint = " (--hydra-help lists Hydra's flags; an override is key=value)" if message.startswith("unrecognized") else ""
        raise ConfigError(message + hint)

    hydra_parser = get_args_parser()
    hydra_parser.error = refuse  # type: ignore[method-assign]  # one line, exit 2, like every configuration error
    return hydra_parser


def split(args: Sequence[str], hydra_parser: argparse.ArgumentParser | None = None) -> tuple[list[str], list[str]]:
    """(Hydra's flags with their values, the overrides). An override never starts with '-', so
    every such argument is a flag (an unknown one is left for the parser to name). A flag that
    takes a value takes the next argument, as argparse does, except that ``--info``'s optional
    value is never an override (``--info model=cnn`` is ``--info`` and ``model=cnn``)."""
    if not any(_is_flag(a) for a in args):
        return [], list(args)
    actions = {s: a for a in (hydra_parser or parser())._actions for s in a.option_strings}
    flags: list[str] = []
    overrides: list[str] = []
    i = 0
    while i < len(args):
        arg = args[i]
        if not _is_flag(arg):
            overrides.append(arg)
            i += 1
            continue
        flags.append(arg)
        name = arg.split("=", 1)[0]
        if name not in actions:  # argparse's unique prefixes: --hydra-h is --hydra-help
            prefixed = [s for s in actions if name.startswith("--") and s.startswith(name)]
            name = prefixed[0] if len(prefixed) == 1 else name
        action = actions.get(name)
        following = args[i + 1] if i + 1 < len(args) else None
        if action is not None and "=" not in arg and following is not None and not following.startswith("-") and (
            action.nargs is None  # --cfg VALUE, -p VALUE, -cn VALUE: argparse takes it, whatever it is
            or action.nargs == "?" and (following in (action.choices or ()) or not _is_override(following))
        ):
            flags.append(following)
            i += 1
        i += 1
    return flags, overrides


def _is_flag(arg: str) -> bool:
    return arg.startswith("-") and arg != "-"  # a lone '-' is no flag; the override parser names it


def _is_override(arg: str) -> bool:
    return "=" in arg or arg.startswith("~")  # key=value, +key=value, ++key=value, ~key


def dispatch(stage: str, args: Sequence[str], *, root: Path | None = None) -> tuple[int | None, list[str]]:
    """Hydra's flags among a stage's arguments: ``(exit code, [])`` when a flag did its work
    (printed a configuration, help, a script), ``(None, overrides)`` when the stage should run
    with ``overrides``. A refused flag or a bad value raises ConfigError; see the module docstring."""
    hydra_parser = parser() if any(_is_flag(a) for a in args) else None
    flags, overrides = split(args, hydra_parser)
    if hydra_parser is None:
        if sweeps(overrides):
            raise sweep_error(stage, overrides)
        return None, overrides
    try:
        ns = hydra_parser.parse_args(flags)
    except SystemExit as exc:  # --version: argparse printed Hydra's version
        return (exc.code if isinstance(exc.code, int) else 1), []
    if ns.overrides:  # argparse reads a flag-like word it does not know (-1) as an override: it would vanish
        raise ConfigError(f"unrecognized arguments: {' '.join(ns.overrides)} (--hydra-help lists Hydra's flags; an override is key=value)")
    if ns.multirun or (not ns.shell_completion and sweeps(overrides)):  # -sc's install=bash is no override
        raise sweep_error(stage, overrides)
    if ns.experimental_rerun is not None:
        raise ConfigError(f"--experimental-rerun reruns a Hydra job from its pickled config; a stage writes none: DVC reruns it "
                          f"(dvc repro -s {stage}), or run it again with the same overrides (python -m pipeline.{stage} KEY=VALUE ...)")
    for value, flag in ((ns.config_name, "--config-name/-cn"), (ns.config_path, "--config-path/-cp"), (ns.config_dir, "--config-dir/-cd")):
        if value is not None:
            raise ConfigError(f"{flag} {value}: a stage's primary config is params.yaml (what DVC tracks and runs), composed from "
                              "conf/config.yaml: choose values with overrides (optimizer.lr=1e-2) or a conf/ group option "
                              "(model=cnn; a new option is a new file in conf/<group>/), or run an experiment: dvc exp run -S model=cnn")
    shows_cfg = ns.cfg is not None
    if ns.run + shows_cfg + ns.shell_completion + (ns.info is not None) > 1:  # Hydra's words (_run_hydra)
        raise ConfigError("Only one of --run, --multirun, --cfg, --info and --shell_completion can be specified")
    if ns.resolve and not shows_cfg:  # Hydra's rule; its -h is the stage's own usage, which resolves nothing
        raise ConfigError(f"The --resolve flag can only be used in conjunction with --cfg (python -m pipeline.{stage} --cfg job --resolve)")
    if ns.hydra_help:
        hydra_overrides = [o for o in overrides if re.match(r"[+~]*hydra\b", o)]  # Hydra's help composes no primary config
        return run_hydra(stage, flags, hydra_overrides, root=root), []
    if ns.shell_completion:
        return shell_completion(stage, overrides, root=root), []
    if shows_cfg or ns.info is not None:
        return run_hydra(stage, flags, overrides, root=root), []
    if ns.package is not None:  # Hydra's _run_hydra reads --package only for --cfg and runs the job
        print(f"{stage}: --package {ns.package} only picks what --cfg shows (python -m pipeline.{stage} --cfg job -p {ns.package}); "
              "ignored, as Hydra does, and the stage runs", file=sys.stderr)
    return None, overrides  # --run (Hydra's default mode), or -p alone: the stage runs


def sweep_error(stage: str, overrides: Sequence[str]) -> ConfigError:
    """How to sweep, for ``-m`` or a sweep override on a stage."""
    sets = " ".join(f"-S '{o}'" for o in overrides if not o.startswith("-")) or "-S 'optimizer.lr=1e-3,3e-3'"
    return ConfigError(f"a stage runs one configuration (its outputs are data/{stage}/): sweep as DVC experiments, each in its "
                       f"own copy: dvc exp run --queue {sets} && dvc queue start (then dvc exp show)")


def run_hydra(stage: str, flags: Sequence[str], overrides: Sequence[str], *, root: Path | None = None,
              primary_overrides: Sequence[str] | None = None) -> int:
    """Hydra's entry point over the stage's primary config (params.yaml with ``overrides``'
    group switches, or conf/), for ``--cfg``/``--info``/``--hydra-help``/``--version`` and
    ``-sc query=...``. The overrides are checked first (a bad one is our one-line ConfigError,
    exit 2); ``primary_overrides``, when given, are the ones whose group switches the primary
    config takes instead, unchecked (a completion's, which Hydra reads from COMP_LINE)."""
    import hydra

    from pipeline.config.load import CONFIG_NAME, load, read_params, register_params_primary
    from pipeline.paths import project_root

    root = Path(root) if root is not None else project_root()
    if primary_overrides is None:
        load(overrides, root=root)  # raises ConfigError naming the key
    params = root / "params.yaml"
    name = CONFIG_NAME
    if params.is_file():
        try:
            name = register_params_primary(read_params(params), overrides if primary_overrides is None else primary_overrides, root)
        except ConfigError:
            if primary_overrides is None:
                raise
            name = register_params_primary(read_params(params), [], root)  # a half-typed line completes without its switches

    def task(cfg) -> None:  # never called: each flag here shows and exits
        raise AssertionError("Hydra ran the task for a show-only flag")

    argv = sys.argv
    # Hydra's help prints this as the command (its eval "$(... -sc install=bash)" line); flags last: a bare --info takes no override
    sys.argv = [f"python -m pipeline.{stage}", *overrides, *flags]
    try:
        hydra.main(config_path=str(root / "conf"), config_name=name, version_base=None)(task)()
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 1
    finally:
        sys.argv = argv
    return 0


def shell_completion(stage: str, overrides: Sequence[str], *, root: Path | None = None) -> int:
    """``-sc install=SHELL``/``uninstall=SHELL``: print the script; ``-sc query=SHELL`` (what the
    script runs, with the shell's COMP_LINE): Hydra's completions for the line's last word."""
    from hydra.core.plugins import Plugins
    from hydra.plugins.completion_plugin import CompletionPlugin
    from omegaconf import OmegaConf

    install = f'eval "$(python -m pipeline.{stage} -sc install=bash)"'
    try:
        subcommands = OmegaConf.from_dotlist(list(overrides))  # Hydra's reading of the subcommand
    except Exception:  # omegaconf's errors on a line that is no dotlist
        subcommands = OmegaConf.create()
    given = [c for c in COMPLETION_COMMANDS if c in subcommands]
    if len(given) != 1:
        raise ConfigError(f"--shell-completion/-sc takes one of install=bash, uninstall=bash, query=bash (Hydra's subcommands, "
                          f"one at a time; zsh: =zsh); to install it in this shell: {install}")
    command = given[0]
    shell = str(subcommands[command])
    shells = sorted(p.provides() for p in Plugins.instance().discover(CompletionPlugin) if issubclass(p, CompletionPlugin))
    if shell not in shells:
        raise ConfigError(f"-sc {command}={shell}: no completion for {shell!r}; Hydra's shells: {', '.join(shells)}")
    if command == "query":
        return _query(stage, shell, root=root)
    if shell == "fish":
        raise ConfigError(f"-sc {command}=fish: Hydra's fish completion registers a script file or an installed command, never "
                          f"python -m pipeline.{stage}; bash and zsh are supported: {install}")
    names = " ".join(dict.fromkeys(("python", "python3", os.path.basename(sys.executable))))  # the interpreter as typed
    script = INSTALL_SCRIPT if command == "install" else UNINSTALL_SCRIPT
    sys.stdout.write(script.format(stage=stage, names=names, function=COMPLETION_FUNCTION))
    return 0


def _query(stage: str, shell: str, *, root: Path | None = None) -> int:
    """Hydra's completion of COMP_LINE (``python -m pipeline.<stage> ...``): Hydra's plugin
    strips a ``python <file>`` or a command name, so the line is handed on as
    ``pipeline.<stage> ...``, the form of an installed command."""
    from hydra._internal.utils import get_args

    line = os.environ.get("COMP_LINE")
    if line is None:
        raise ConfigError(f"-sc query={shell} is what the installed completion runs, with the shell's COMP_LINE; "
                          f'install it: eval "$(python -m pipeline.{stage} -sc install=bash)"')
    match = re.match(rf"\s*\S+\s+-m\s+pipeline\.{stage}(?:\s|$)(.*)", line, re.DOTALL)
    rest = match.group(1) if match else line
    typed = get_args(rest.split()).overrides
    complete = typed if not rest or rest[-1].isspace() else typed[:-1]  # the last word is being typed
    os.environ["COMP_LINE"] = f"pipeline.{stage} {rest}"
    try:
        return run_hydra(stage, ["-sc"], [f"query={shell}"], root=root, primary_overrides=complete)
    finally:
        os.environ["COMP_LINE"] = line


def sweeps(overrides: Sequence[str]) -> list[str]:
    """The overrides that sweep (``key=a,b``, ``range()``, ``choice()``); a parse error is left to ``load``."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    try:
        parsed = OverridesParser.create().parse_overrides(list(overrides))
    except HydraException:
        return []
    return [o.input_line or "" for o in parsed if o.is_sweep_override()]
