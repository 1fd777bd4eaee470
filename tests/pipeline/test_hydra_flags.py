"""Hydra's own flags on a stage, run as a Hydra user types them, checked against what Hydra
documents each flag to do (hydra.cc, "Command line flags"): ``--cfg job`` prints the job's
config as YAML, ``--cfg hydra`` Hydra's, ``--info`` the search path, defaults tree and config,
``--hydra-help`` Hydra's flags; ``-m`` is refused with the DVC command that sweeps. Every
other flag ``--hydra-help`` lists is run beside a real ``@hydra.main`` app given the same
flags: the stage does what Hydra does (its errors, its completions) or refuses in one line."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import yaml

from tests.pipeline.conftest import REPO


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """params.yaml as `dvc exp run -S optimizer.lr=1e-3` leaves it (conf/ says 3e-3)."""
    root = tmp_path_factory.mktemp("ws")
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    params["optimizer"]["lr"] = 1e-3
    (root / "params.yaml").write_text(yaml.safe_dump(params))
    (root / "conf").symlink_to(REPO / "conf")
    return root


def stage(root, *args):
    env = {**os.environ, "ODT_PROJECT_ROOT": str(root)}
    return subprocess.run([sys.executable, "-m", "pipeline.train", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=120)


def test_cfg_job_prints_the_configuration_the_stage_would_run(workspace):
    proc = stage(workspace, "--cfg", "job", "tracking=disabled")
    assert proc.returncode == 0, proc.stderr
    cfg = yaml.safe_load(proc.stdout)
    assert "hydra" not in cfg  # job only
    assert cfg["optimizer"]["lr"] == 1e-3
    assert cfg["tracking"]["enabled"] is False  # params.yaml plus the override
    proc = stage(workspace, "--cfg", "job", "--package", "optimizer")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("# @package optimizer")
    assert yaml.safe_load(proc.stdout)["lr"] == 1e-3  # Hydra's package view
    proc = stage(workspace, "-c", "hydra")
    assert proc.returncode == 0, proc.stderr
    assert yaml.safe_load(proc.stdout)["hydra"]["run"]["dir"] == "."  # conf/config.yaml's hydra node


def test_info_and_hydra_help_are_hydras(workspace):
    proc = stage(workspace, "model=cnn", "--info")
    assert proc.returncode == 0, proc.stderr
    for section in ("Config search path", "Defaults Tree", "Config"):
        assert section in proc.stdout, proc.stdout[:2000]
    assert "model: cnn" in proc.stdout
    assert f"file://{workspace / 'conf'}" in proc.stdout  # the switched group, conf/ searched
    proc = stage(workspace, "--hydra-help")
    assert proc.returncode == 0, proc.stdout
    assert "--cfg,-c" in proc.stdout, proc.stdout
    assert "--multirun,-m" in proc.stdout, proc.stdout


def test_multirun_says_how_to_sweep(workspace):
    for args in (["-m", "optimizer.lr=1e-3,3e-3"], ["optimizer.lr=1e-3,3e-3"]):
        proc = stage(workspace, *args)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2, proc.stderr
        assert len(lines) == 1, proc.stderr
        assert "dvc exp run --queue -S 'optimizer.lr=1e-3,3e-3'" in lines[0]
        assert "Traceback" not in proc.stderr


def test_a_bad_override_with_cfg_is_one_line(workspace):
    proc = stage(workspace, "--cfg", "job", "optimizer.lrr=1")
    assert proc.returncode == 2, proc.stderr
    assert "optimizer.lrr" in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


# Every other flag Hydra's --hydra-help lists, against Hydra itself: HYDRA_APP is a real
# @hydra.main app over the repository's conf/ (the stages' primary config as DVC composes it),
# run with the same flags; the stage either does what it does or refuses in one line (exit 2).
HYDRA_APP = """\
import sys

import hydra


@hydra.main(config_path=sys.argv.pop(1), config_name="config", version_base=None)
def main(cfg):
    print("RAN", cfg.optimizer.lr)


main()
"""


@pytest.fixture(scope="module")
def hydra_app(tmp_path_factory):
    app = tmp_path_factory.mktemp("hydra_app") / "app.py"
    app.write_text(HYDRA_APP)

    def run(*args, **env):
        return subprocess.run([sys.executable, str(app), str(REPO / "conf"), *args], cwd=app.parent, capture_output=True, text=True,
                              timeout=120, env={**os.environ, **env})
    return run


@pytest.fixture
def in_process(workspace, monkeypatch, capsys):
    """The stage's main() in this process over the workspace, its run() recording the config
    it got instead of training: (exit code, stdout, stderr lines, the configs run)."""
    from pipeline.stage import main

    monkeypatch.setenv("ODT_PROJECT_ROOT", str(workspace))

    def call(*args):
        ran = []
        code = main("train", lambda cfg, paths, tracker: ran.append(cfg) or {"loss": 1.0}, list(args))
        out, err = capsys.readouterr()
        return code, out, err.strip().splitlines(), ran
    return call


def hydra_error(proc) -> str:
    """Hydra's message: argparse's after its usage, or the exception's last line after a traceback."""
    last = proc.stderr.strip().splitlines()[-1]
    return last.split(": error: ", 1)[1] if ": error: " in last else last.split(": ", 1)[1]


def test_bad_values_give_hydras_argparse_error(workspace, hydra_app):
    for args in (["--cfg", "bogus"], ["--info", "bogus"], ["-p"]):
        theirs, ours = hydra_app(*args), stage(workspace, *args)
        assert theirs.returncode == ours.returncode == 2, (args, ours.stderr)
        assert ours.stderr.strip().splitlines() == [f"train: error: {hydra_error(theirs)}"], (args, theirs.stderr)
    assert "(choose from 'job', 'hydra', 'all')" in hydra_error(hydra_app("-c", "bogus"))  # the message names the values


def test_run_and_package_alone_run_the_stage_as_hydra_runs_the_app(hydra_app, in_process):
    for args in (["--run", "optimizer.lr=0.01"], ["-r", "optimizer.lr=0.01"], ["-p", "optimizer", "optimizer.lr=0.01"]):
        theirs = hydra_app(*args)
        assert theirs.returncode == 0 and theirs.stdout.split() == ["RAN", "0.01"], theirs.stderr  # Hydra runs the task
        code, _, err, ran = in_process(*args, "tracking=disabled")
        assert code == 0, err
        assert [cfg.optimizer.lr for cfg in ran] == [0.01]
    assert err[0] == ("train: --package optimizer only picks what --cfg shows (python -m pipeline.train --cfg job -p optimizer); "
                      "ignored, as Hydra does, and the stage runs")


def test_hydras_rules_are_one_line_errors(hydra_app, in_process):
    """Hydra's own checks (a traceback, exit 1, from a Hydra app) are the stage's one line, exit 2."""
    for args in (["--cfg", "job", "--info"], ["--run", "--cfg", "job"], ["--resolve"]):
        theirs = hydra_app(*args)
        assert theirs.returncode == 1, theirs.stderr
        code, _, err, ran = in_process(*args)
        assert code == 2 and len(err) == 1 and not ran, err
        assert hydra_error(theirs).split(" or --help")[0] in err[0]  # the stage's -h is its own usage: no --resolve there


def test_flags_that_do_not_apply_to_a_stage_are_refused_in_one_line(hydra_app, in_process):
    refused = {("-cn", "config"): "model=cnn", ("--config-name", "config"): "model=cnn", ("-cp", str(REPO / "conf")): "model=cnn",
               ("-cd", str(REPO / "conf")): "conf/<group>/", ("--experimental-rerun", "config.pickle"): "dvc repro -s train"}
    for args, alternative in refused.items():
        code, out, err, ran = in_process(*args, "tracking=disabled")
        assert code == 2 and len(err) == 1 and not ran and not out, err
        assert args[0] in err[0] and alternative in err[0], err
    theirs = hydra_app("-cn", "config", "optimizer.lr=0.01")  # Hydra: another primary config; the stage's is params.yaml
    assert theirs.stdout.split() == ["RAN", "0.01"], theirs.stderr


def test_every_flag_hydra_lists_is_handled(in_process):
    """No flag of Hydra's parser reaches the override parser ("cannot parse the overrides")."""
    from hydra._internal.utils import get_args_parser

    for action in get_args_parser()._actions:
        for flag in action.option_strings:
            value = [] if action.nargs in (0, "?") else [str((action.choices or ["x"])[0])]
            code, _, err, _ = in_process(flag, *value, "tracking=disabled", "optimizer.lrr=1")  # a run stops at the typo
            assert code in (0, 2), (flag, err)
            assert not any("cannot parse the overrides" in line for line in err), (flag, err)


def completions(run, line, **env):
    proc = run("-sc", "query=bash", COMP_LINE=line, **env)
    assert proc.returncode == 0, proc.stderr
    return sorted(proc.stdout.split())


def test_shell_completion_completes_a_stage_as_hydra_completes_an_app(workspace, hydra_app):
    """The completions are Hydra's (its plugin, over params.yaml); the script is the stage's:
    Hydra's completes `python <file.py>`, never `python -m pipeline.<stage>`."""
    def ours(*args, **env):
        return subprocess.run([sys.executable, "-m", "pipeline.train", *args], cwd=REPO, capture_output=True, text=True, timeout=120,
                              env={**os.environ, "ODT_PROJECT_ROOT": str(workspace), **env})

    for typed in ("mod", "model=", "model=cnn model.k", "--cfg job optimizer.l"):
        assert completions(ours, f"python -m pipeline.train {typed}") == completions(hydra_app, f"python app.py {typed}"), typed
    assert completions(ours, "python -m pipeline.train optimizer.lr=") == ["optimizer.lr=0.001"]  # params.yaml's, not conf/'s 3e-3

    helped = ours("--hydra-help").stdout
    install = next(line.strip() for line in helped.splitlines() if "-sc install=bash" in line)
    assert install == 'eval "$(python -m pipeline.train -sc install=bash)"'
    venv = os.path.dirname(sys.executable)
    script = f"""{install}
COMP_LINE='python -m pipeline.train model=c' COMP_POINT=31 COMP_CWORD=3; _odt_stage_completion; echo "${{COMPREPLY[@]}}"
complete -p python
eval "$(python -m pipeline.train -sc uninstall=bash)"
complete -p python 2> /dev/null || echo uninstalled
"""
    proc = subprocess.run(["bash", "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PATH": f"{venv}:{os.environ['PATH']}", "ODT_PROJECT_ROOT": str(workspace)})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["model=cnn", "complete -o default -o nospace -F _odt_stage_completion python", "uninstalled"]


def test_shell_completion_errors_are_one_line(hydra_app, in_process):
    theirs = hydra_app("-sc")
    assert theirs.returncode == 1 and "Expecting one subcommand from ['install', 'uninstall', 'query']" in theirs.stderr
    for args, says in ((["-sc"], "install=bash, uninstall=bash, query=bash"), (["-sc", "install=tcsh"], "bash, fish, zsh"),
                       (["-sc", "install=fish"], 'eval "$(python -m pipeline.train -sc install=bash)"')):
        code, out, err, _ = in_process(*args)
        assert code == 2 and len(err) == 1 and says in err[0], err


def test_config_entry_point_has_usage():
    def config(*args):
        return subprocess.run([sys.executable, "-m", "pipeline.config", *args], cwd=REPO, capture_output=True, text=True, timeout=120)

    proc = config("--help")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: python -m pipeline.config [--check | --write] [OVERRIDE ...]")
    assert "--check" in proc.stdout and "--write" in proc.stdout
    proc = config("--wirte")
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        "config error: unrecognized option --wirte; the options are --check, --write, --help"]
