"""conf/ composes, params.yaml stays its composition, and bad configuration is stopped
before any work with a message naming the key and what is allowed."""
from __future__ import annotations

import re
import subprocess
import sys

import pytest
import yaml
from omegaconf import OmegaConf

from odt_ops.onnxblock import optim
from pipeline import config
from pipeline.config import ConfigError
from pipeline.convert import Arch, ModelSource
from pipeline.selection import Select
from tests.pipeline.conftest import REPO, load_cfg


def test_params_yaml_is_the_composition_of_conf():
    """params.yaml is committed for `dvc repro`; `dvc exp run` rewrites it from conf/."""
    assert (REPO / "params.yaml").read_text(encoding="utf-8") == config.compose_yaml(root=REPO), (
        "params.yaml differs from conf/: run `python -m pipeline.config --write`"
    )


@pytest.mark.parametrize(
    "group,option", [(g, o) for g, opts in config.group_options(REPO).items() for o in opts]
)
def test_every_group_option_composes_and_validates(group, option):
    cfg = load_cfg(f"{group}={option}")
    assert cfg.seed == 0


def test_defaults_and_types():
    cfg = load_cfg()
    assert cfg.model.source is ModelSource.builtin
    assert cfg.model.arch is Arch.mlp
    assert cfg.optimizer.block["_target_"] == "odt_ops.onnxblock.optim.AdamW"
    assert isinstance(cfg.optimizer.lr, float)
    assert cfg.optimizer.block["betas"] == [0.9, 0.999]
    assert cfg.trainable.select is Select.last_n
    assert cfg.trainable.last_n == 1  # head only
    sgd = load_cfg("optimizer=sgd", "optimizer.lr=0.1")
    assert sgd.optimizer.block["momentum"] == 0.9
    assert sgd.optimizer.lr == 0.1
    assert config.build(sgd.optimizer.block) == optim.SGD(momentum=0.9)  # the engine's block, built from conf/


def test_sections_are_typed_dataclasses_with_every_value_from_conf():
    """The YAML holds the values: a key missing from params.yaml is an error naming it, not a
    default from Python."""
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    del params["train"]["epochs"]
    with pytest.raises(ConfigError, match=r"^train.epochs: missing; expected an integer"):
        config.validate(OmegaConf.create(params))


@pytest.mark.parametrize(
    "overrides,needles",
    [
        (["optimizer.lrr=3e-3"], ["optimizer.lrr", "'optimizer' takes", "did you mean 'optimizer.lr'"]),
        (["+optimizer.lrr=3e-3"], ["optimizer.lrr", "block, lr, schedule"]),
        (["model=cnnn"], ["model=cnnn", "cnn, mlp, onnx_file, torch"]),
        (["optimizer.lr=abc"], ["optimizer.lr='abc'", "expected a number"]),
        (["optimizer=adamm"], ["optimizer=adamm", "adam, adamw, sgd", "did you mean 'adam'"]),
        (["device.max_steps=many"], ["device.max_steps", "an integer or null"]),
        (["data.input_shape=[1,x,8]"], ["data.input_shape[1]", "an integer"]),
        (["train.shuffle=maybe"], ["train.shuffle", "true or false"]),
        (["optimizer=sgd", "+optimizer.block.betas=[0.9,0.9]"],
         ["optimizer.block.betas", "SGD takes: max_norm, momentum, nesterov, weight_decay", "argument of odt_ops.onnxblock.optim.Adam"]),
        # _target_ is checked against the engine's classes before anything is imported or built
        (["optimizer.block._target_=os.system"],
         ["optimizer.block._target_='os.system'", "allowed targets: odt_ops.onnxblock.optim.Adam, odt_ops.onnxblock.optim.AdamW, "
          "odt_ops.onnxblock.optim.SGD"]),
        (["pretrain.optimizer._target_=builtins.eval"], ["pretrain.optimizer._target_='builtins.eval'", "odt_ops.onnxblock.optim.AdamW"]),
        (["loss._target_=odt_ops.onnxblock.loss.MSE"], ["loss._target_='odt_ops.onnxblock.loss.MSE'",
                                                         "did you mean 'odt_ops.onnxblock.loss.MSELoss'"]),
        (["~optimizer.block._target_"], ["optimizer.block: needs _target_", "odt_ops.onnxblock.optim.SGD"]),
        # constructor arguments: the target's own, named with the key
        (["+optimizer.block.betass=[0.9,0.9]"], ["unknown key 'optimizer.block.betass'", "AdamW takes: betas, eps, max_norm, mode, weight_decay",
                                                  "did you mean 'optimizer.block.betas'"]),
        (["optimizer.block.betass=[0.9,0.9]"], ["optimizer.block.betass", "SGD: max_norm, momentum, nesterov, weight_decay"]),
        (["loss=mse", "+loss.label_smoothing=0.1"], ["unknown key 'loss.label_smoothing'", "MSELoss takes: reduction",
                                                     "argument of odt_ops.onnxblock.loss.CrossEntropyLoss only"]),
        # the arguments' values
        (["optimizer.block.betas=[0.9,1.0]"], ["optimizer.block.betas=[0.9, 1.0]", "two numbers in [0, 1)"]),
        (["optimizer.block.betas=[-0.1,0.9]"], ["optimizer.block.betas=[-0.1, 0.9]", "two numbers in [0, 1)"]),
        (["optimizer.block.eps=0"], ["optimizer.block.eps=0", "a number > 0"]),
        (["optimizer=sgd", "optimizer.block.momentum=1.5"], ["optimizer.block.momentum=1.5", "[0, 1)"]),
        (["optimizer=sgd", "optimizer.block.nesterov=maybe"], ["optimizer.block.nesterov='maybe'", "true or false"]),
        (["loss.reduction=none"], ["loss.reduction='none'", "mean or sum"]),
        (["pretrain.lr=0"], ["pretrain.lr=0.0", "a number > 0"]),
        # what only the engine's constructor knows, reported with the node's key
        (["optimizer=sgd", "optimizer.block.momentum=0", "optimizer.block.nesterov=true"],
         ["optimizer.block: odt_ops.onnxblock.optim.SGD rejects its arguments", "nesterov needs momentum > 0"]),
        # a nested section's check names the whole path
        (["data.style.stroke=-1"], ["data.style.stroke=-1", "an integer >= 0"]),
        (["federated.dp.clipping_norm=0"], ["federated.dp.clipping_norm=0.0", "a number > 0"]),
        (["optimizer.lr=-1"], ["optimizer.lr=-1.0", "a finite number > 0"]),
        (["optimizer.lr=inf"], ["optimizer.lr=inf", "a finite number > 0"]),
        (["optimizer.lr=nan"], ["optimizer.lr=nan", "a finite number > 0"]),
        (["trainable.select=globs"], ["trainable.params", "at least one glob"]),
        (["model=onnx_file", "model.path=null"], ["model.path=null", "zoo:<name>"]),
        (["optimizer.lr"], ["optimizer.lr", "Hydra grammar"]),
    ],
)
def test_bad_overrides_name_the_key_and_the_allowed_values(overrides, needles):
    with pytest.raises(ConfigError) as info:
        load_cfg(*overrides)
    message = str(info.value)
    for needle in needles:
        assert needle in message, message
    assert "\n" not in message


def test_params_yaml_with_a_wrong_type_is_rejected(tmp_path):
    """DVC composes without the schema, so `dvc exp run -S optimizer.lr=abc` reaches
    the stages; the first one stops before any work."""
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    params["optimizer"]["lr"] = "abc"
    params["train"]["typo"] = 1
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    with pytest.raises(ConfigError, match=r"optimizer.lr='abc': expected a number|unknown key 'train.typo'"):
        config.load([], root=tmp_path)


def test_load_rule_params_yaml_without_overrides_conf_with_them(tmp_path):
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    params["optimizer"]["lr"] = 0.123
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    (tmp_path / "conf").symlink_to(REPO / "conf")
    assert config.load([], root=tmp_path).optimizer.lr == 0.123
    assert config.load(["optimizer.lr=0.5"], root=tmp_path).optimizer.lr == 0.5
    assert config.source_of([], root=tmp_path) == "params.yaml"


def test_stage_cli_prints_one_line_and_exits_2_on_a_typo(project):
    """The real command line, as a person types it: no traceback, exit code 2."""
    proc = subprocess.run(
        [sys.executable, "-m", "pipeline.prepare", "optimizer.lrr=3e-3"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1
    assert "optimizer.lrr" in lines[0]
    assert "Traceback" not in proc.stderr
    assert not (project / "data").exists()  # nothing was written


def test_dvc_yaml_stages_read_existing_params_and_never_tracking():
    dvc = yaml.safe_load((REPO / "dvc.yaml").read_text())
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    for name, stage in dvc["stages"].items():
        assert stage["cmd"] == f"sh pipeline/stage.sh {name}"  # python -m pipeline.<name>, with the project's python
        assert f"pipeline/{name}.py" in stage["deps"]
        assert "pipeline/config" in stage["deps"]
        for dep in stage["deps"]:
            assert (REPO / dep).exists() or dep.startswith("data/") and dep.split("/")[1] in dvc["stages"], dep
        for key in stage["params"]:
            node = params
            for part in key.split("."):
                assert part in node, f"stage {name}: param {key} is not in params.yaml"
                node = node[part]
        assert not any(str(k).startswith(("tracking", "retrain")) for k in stage["params"])  # settings that never rerun a stage
        for out in stage.get("outs", []) + stage.get("metrics", []) + stage.get("plots", []):
            out = next(iter(out)) if isinstance(out, dict) else out
            assert out == f"data/{name}" or out.startswith(f"data/{name}/"), f"stage {name} writes {out} outside data/{name}/"


def test_hydra_settings_keep_outputs_and_cwd():
    """The hydra: node stays out of params.yaml and keeps @hydra.main tools in place."""
    text = (REPO / "conf" / "config.yaml").read_text()
    node = yaml.safe_load(text)["hydra"]
    assert node == {"run": {"dir": "."}, "output_subdir": None, "job": {"chdir": False}}
    assert "hydra" not in yaml.safe_load((REPO / "params.yaml").read_text())
    for path in (REPO / "conf").rglob("*.yaml"):  # DVC would bake resolved env/time values into params.yaml
        assert "${" not in re.sub(r"#.*", "", path.read_text()), path


@pytest.fixture
def workspace_lr_1e3(tmp_path):
    """A workspace as `dvc exp run -S optimizer.lr=1e-3` leaves it: params.yaml differs from conf/."""
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    params["optimizer"]["lr"] = 1e-3
    params["train"]["epochs"] = 7
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    (tmp_path / "conf").symlink_to(REPO / "conf")
    return tmp_path


def test_a_hand_run_is_params_yaml_plus_the_overrides(workspace_lr_1e3):
    """What DVC would run, plus my overrides: values nobody overrode stay params.yaml's."""
    root = workspace_lr_1e3
    cfg = config.load(["tracking=disabled"], root=root)
    assert cfg.optimizer.lr == 1e-3
    assert cfg.train.epochs == 7
    assert cfg.tracking.enabled is False
    cfg = config.load(["train.epochs=2"], root=root)
    assert cfg.optimizer.lr == 1e-3
    assert cfg.train.epochs == 2
    assert config.source_of(["train.epochs=2"], root=root) == "params.yaml + overrides: train.epochs=2"
    assert config.recomposed(["train.epochs=2"], root=root) is None


def test_a_group_switch_recomposes_only_its_section_and_says_so(workspace_lr_1e3):
    """Hydra's oracle: the switched section equals Hydra's own composition of conf/ with that
    option; every other section stays params.yaml's."""
    root = workspace_lr_1e3
    cfg = config.to_container(config.load(["optimizer=sgd", "tracking=disabled"], root=root))
    hydra_sgd = OmegaConf.to_container(config.compose(["optimizer=sgd"], root=REPO), resolve=True)
    assert cfg["optimizer"] == hydra_sgd["optimizer"]  # lr 0.05, SGD's block: the option's values
    assert cfg["train"]["epochs"] == 7  # untouched sections keep params.yaml's values
    note = config.recomposed(["optimizer=sgd", "tracking=disabled", "train.epochs=3"], root=root)
    assert note is not None
    assert len(note.splitlines()) == 1
    assert "conf/optimizer/sgd.yaml" in note
    assert "conf/tracking/disabled.yaml" in note
    assert "train" not in note.split(";")[0]
    cfg = config.load(["model=cnn", "optimizer.lr=0.5"], root=root)  # a switch and a value, as the issue writes them
    assert cfg.model.arch is Arch.cnn
    assert cfg.optimizer.lr == 0.5
    assert cfg.train.epochs == 7


def test_overrides_on_params_yaml_keep_hydra_errors(workspace_lr_1e3):
    root = workspace_lr_1e3
    with pytest.raises(ConfigError, match=r"unknown key 'optimizer.lrr'.*did you mean 'optimizer.lr'"):
        config.load(["optimizer.lrr=1"], root=root)
    with pytest.raises(ConfigError, match=r"model=cnnn: no such option .*allowed: cnn, mlp"):
        config.load(["model=cnnn"], root=root)
