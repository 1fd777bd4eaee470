"""pretrain, generate, train, evaluate, export as functions (no DVC, no MLflow): the
demo's personalization pays off, what is trainable follows the config, training is
seeded and resumable, the exported model runs on onnxruntime, bad input is named."""
from __future__ import annotations

import csv
import hashlib
import json
import shutil
import subprocess
import sys

import numpy as np
import onnx
import pytest

from odt_ops.checkpoint import load_checkpoint
from odt_ops.export import apply_diff, load_diff
from pipeline import convert, evaluate, export, generate, pretrain, train
from pipeline.errors import ConfigError, DataError
from pipeline.io import load_npz, save_npz, sha256_file, write_digests
from pipeline.paths import Paths
from tests.pipeline.conftest import REPO, TINY_RUN, copy_outputs, load_cfg, run_stages

ort = pytest.importorskip("onnxruntime")


def digest(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# --------------------------------------------------------------------------- the demo


def test_default_demo_personalization_pays_off(prepared, tmp_path):
    """At the defaults (what `dvc repro` runs): the personalized model beats the base on
    the user's holdout by at least 10 points; the forgetting on the global test is reported."""
    paths = copy_outputs(prepared, tmp_path, stages=("prepare",))
    cfg = load_cfg()
    convert.run(cfg, paths)
    metrics = run_stages(cfg, paths)
    m = json.loads((paths.out("evaluate") / "metrics.json").read_text())
    base, personal = m["user_holdout"]["base"]["accuracy"], m["user_holdout"]["personalized"]["accuracy"]
    assert m["global_test"]["base"]["accuracy"] > 0.9  # a good global model...
    assert base < 0.7  # ...that reads this user badly
    assert personal - base >= 0.10, m
    assert m["personalization_gain"] == pytest.approx(personal - base)
    assert m["forgetting"] == pytest.approx(m["global_test"]["base"]["accuracy"] - m["global_test"]["personalized"]["accuracy"])
    assert evaluate.summary(metrics["evaluate"]).startswith("user holdout: base")
    # the evaluation's base is pretrain's model, measured the same way there
    pre = json.loads((paths.out("pretrain") / "metrics.json").read_text())
    assert pre["user_holdout"]["accuracy"] == pytest.approx(base)


# --------------------------------------------------------------------------- pretrain


def test_pretrain_trains_fresh_sources_and_keeps_onnx_files(tiny_run, tmp_path):
    m = json.loads((tiny_run.out("pretrain") / "metrics.json").read_text())
    assert m["trained"] == 1
    assert m["steps"] > 0
    assert m["global_test"]["accuracy"] > 0.5
    assert digest(tiny_run.out("pretrain") / "base.onnx") != digest(tiny_run.base_model)
    assert pretrain.should_train(load_cfg("model=torch"))
    assert not pretrain.should_train(load_cfg("model=onnx_file"))
    assert not pretrain.should_train(load_cfg("pretrain.mode=skip"))
    assert pretrain.should_train(load_cfg("model=onnx_file", "pretrain.mode=train"))
    paths = copy_outputs(tiny_run, tmp_path, stages=("prepare", "convert"))
    metrics = pretrain.run(load_cfg(*TINY_RUN, "pretrain.mode=skip"), paths)
    assert metrics["trained"] == 0
    assert digest(paths.pretrained_model) == digest(paths.base_model)


# --------------------------------------------------------------------------- generate


@pytest.mark.parametrize(
    "overrides,trainable",
    [
        ([], ["head.weight", "head.bias"]),  # the default: head only
        (["trainable=last2"], ["fc1.weight", "fc1.bias", "head.weight", "head.bias"]),
        (["trainable=all"], ["fc1.weight", "fc1.bias", "head.weight", "head.bias"]),
        (["trainable=bias_and_head"], ["fc1.bias", "head.weight", "head.bias"]),
        (["trainable=all", "trainable.frozen=[fc1.*]"], ["head.weight", "head.bias"]),
        (["trainable.select=globs", "trainable.params=['*.weight']"], ["fc1.weight", "head.weight"]),
    ],
)
def test_generate_trains_what_the_config_selects(tiny_run, tmp_path, overrides, trainable):
    paths = copy_outputs(tiny_run, tmp_path, stages=("pretrain",))
    generate.run(load_cfg(*overrides), paths)
    out = paths.out("generate")
    summary = json.loads((out / "artifacts.json").read_text())
    assert summary["trainable"] == trainable
    ckpt = load_checkpoint(out / "checkpoint")
    assert ckpt.trainable_names() == trainable
    assert set(ckpt.parameters) == {"fc1.weight", "fc1.bias", "head.weight", "head.bias"}  # frozen ones stay: the whole model
    for name in ("training_model.onnx", "eval_model.onnx", "optimizer_model.onnx"):
        onnx.checker.check_model(onnx.load(out / name), full_check=True)
    assert load_checkpoint(out / "nominal_checkpoint").nominal


def test_learning_rate_is_not_baked_into_the_artifacts(tiny_run, tmp_path):
    """Why a new rate reruns train but never generate: the artifacts are byte for byte the same."""
    a, b = copy_outputs(tiny_run, tmp_path / "a", stages=("pretrain",)), copy_outputs(tiny_run, tmp_path / "b", stages=("pretrain",))
    generate.run(load_cfg("optimizer.lr=0.1", "optimizer.schedule.name=cosine"), a)
    generate.run(load_cfg("optimizer.lr=0.0001"), b)
    for name in ("training_model.onnx", "eval_model.onnx", "optimizer_model.onnx", "checkpoint"):
        assert digest(a.out("generate") / name) == digest(b.out("generate") / name), name
    generate.run(load_cfg("optimizer.block.weight_decay=0.5"), b)  # a hyperparameter is baked in
    assert digest(a.out("generate") / "optimizer_model.onnx") != digest(b.out("generate") / "optimizer_model.onnx")


@pytest.mark.parametrize(
    "overrides,needles",
    [
        (["trainable.select=globs", "trainable.params=[nope.*]"], ["trainable.params", "nope.*", "head.weight"]),
        (["trainable.last_n=5"], ["trainable.last_n=5", "2 layer(s)", "fc1: fc1.weight, fc1.bias; logits: head.weight, head.bias"]),
        (["trainable.frozen=[head.*]"], ["leaves nothing to train"]),
    ],
)
def test_generate_bad_trainable_names_the_key(tiny_run, tmp_path, overrides, needles):
    paths = copy_outputs(tiny_run, tmp_path, stages=("pretrain",))
    with pytest.raises(ConfigError) as info:
        generate.run(load_cfg(*overrides), paths)
    for needle in needles:
        assert needle in str(info.value), str(info.value)
    assert not paths.out("generate").exists()


# --------------------------------------------------------------------------- train


def test_train_writes_checkpoints_curve_and_metrics(tiny_run):
    out = tiny_run.out("train")
    m = json.loads((out / "metrics.json").read_text())
    assert m["steps"] == 6
    assert m["epochs"] == 3
    assert m["continued"] == 0
    assert m["total_steps"] == 6  # 30 samples, batch 16
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_000004"]
    final = load_checkpoint(out / "checkpoint")
    assert final.optimizer is not None
    assert final.optimizer.step == 6  # optimizer state included
    assert sorted(final.optimizer.states) == ["head.bias", "head.weight"]
    assert sorted(final.optimizer.states["head.weight"]) == ["exp_avg", "exp_avg_sq"]
    assert load_checkpoint(out / "checkpoints" / "step_000004").optimizer.step == 4
    with open(out / "curve.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["step"]) for r in rows] == list(range(1, 7))
    assert all(float(r["lr"]) == pytest.approx(3e-3) for r in rows)
    base = load_checkpoint(tiny_run.out("generate") / "checkpoint")
    assert not np.array_equal(final.parameters["head.weight"], base.parameters["head.weight"])
    np.testing.assert_array_equal(final.parameters["fc1.weight"], base.parameters["fc1.weight"])  # frozen


def test_train_is_seeded_and_honours_the_device_limits(tiny_run, tmp_path):
    a = copy_outputs(tiny_run, tmp_path / "a", stages=("prepare", "generate"))
    b = copy_outputs(tiny_run, tmp_path / "b", stages=("prepare", "generate"))
    cfg = load_cfg(*TINY_RUN, "optimizer.schedule.name=linear", "optimizer.schedule.warmup_steps=2")
    train.run(cfg, a)
    train.run(cfg, b)
    assert digest(a.out("train") / "checkpoint") == digest(b.out("train") / "checkpoint")
    with open(a.out("train") / "curve.csv", newline="") as f:
        lrs = [float(r["lr"]) for r in csv.DictReader(f)]
    assert lrs[0] == 0
    assert lrs[2] == pytest.approx(3e-3)
    assert lrs[-1] < lrs[2]  # warm-up, then linear decay
    m = train.run(load_cfg(*TINY_RUN, "device=watch"), a)  # batch 4, at most 200 steps
    assert m["steps"] == 3 * 8
    m = train.run(load_cfg(*TINY_RUN, "device.max_steps=5"), a)
    assert m["steps"] == 5
    assert m["stopped_early"] == 1


def test_train_continues_from_a_checkpoint_with_its_optimizer_state(tiny_run, tmp_path):
    paths = copy_outputs(tiny_run, tmp_path, stages=("prepare", "generate"))
    init = tmp_path / "promoted.ckpt"
    shutil.copy(tiny_run.out("train") / "checkpoint", init)
    cfg = load_cfg(*TINY_RUN, f"train.init_checkpoint={init}", f"train.init_sha256={sha256_file(init)}")
    m = train.run(cfg, paths)
    assert m["continued"] == 1
    assert m["resumed_optimizer_state"] == 1
    assert m["total_steps"] == 12
    final = load_checkpoint(paths.out("train") / "checkpoint")
    assert final.optimizer.step == 12  # AdamW's bias correction continues
    # the same 6 steps from the pretrained weights end elsewhere
    assert not np.array_equal(final.parameters["head.weight"], load_checkpoint(tiny_run.out("train") / "checkpoint").parameters["head.weight"])


@pytest.mark.parametrize(
    "setup,overrides,error,needles",
    [
        (lambda d: None, ["train.init_checkpoint={d}/none.ckpt"], DataError, ["none.ckpt", "not found", "train.init_checkpoint=null"]),
        (lambda d: (d / "x.ckpt").write_bytes(b"junk"), ["train.init_checkpoint={d}/x.ckpt"], DataError, ["x.ckpt"]),
        (lambda d: (d / "x.ckpt").write_bytes(b"junk"), ["train.init_checkpoint={d}/x.ckpt", "train.init_sha256=" + "0" * 63 + "a"],
         DataError, ["sha256", "changed"]),
    ],
    ids=["missing", "corrupt", "sha-mismatch"],
)
def test_train_bad_init_checkpoint_names_the_file(tiny_run, tmp_path, setup, overrides, error, needles):
    paths = copy_outputs(tiny_run, tmp_path, stages=("prepare", "generate"))
    setup(tmp_path)
    with pytest.raises(error) as info:
        train.run(load_cfg(*TINY_RUN, *[o.format(d=tmp_path) for o in overrides]), paths)
    for needle in needles:
        assert needle in str(info.value), str(info.value)


def test_init_checkpoint_of_another_model_or_without_its_hash_under_dvc(tiny_run, tmp_path, monkeypatch):
    import odt_ops
    from pipeline import models

    paths = copy_outputs(tiny_run, tmp_path / "p", stages=("prepare", "generate"))
    small = Paths(tmp_path / "s")  # same parameter names, 16 hidden units instead of 64
    small.out("pretrain").mkdir(parents=True)
    odt_ops.save_model(odt_ops.load_model(models.mlp([1, 8, 8], 10, [16], seed=0)), small.pretrained_model)
    generate.run(load_cfg(), small)
    init = small.out("generate") / "checkpoint"
    with pytest.raises(DataError, match=r"does not fit the model.*fc1.weight.*float32\[16, 64\].*train.init_checkpoint=null"):
        train.run(load_cfg(*TINY_RUN, f"train.init_checkpoint={init}"), paths)
    monkeypatch.setenv("DVC_STAGE", "train")
    with pytest.raises(ConfigError, match="train.init_sha256: required under DVC"):
        train.run(load_cfg(*TINY_RUN, f"train.init_checkpoint={init}"), paths)


def test_data_that_does_not_fit_the_model_names_the_file(tiny_run, tmp_path):
    paths = copy_outputs(tiny_run, tmp_path, stages=("prepare", "generate"))
    data = load_npz(paths.split("user_train"))
    save_npz(paths.split("user_train"), x=data["x"][:, :, :7, :7].copy(), y=data["y"])
    write_digests(paths.out("prepare"))  # as if prepare had written it
    with pytest.raises(DataError) as info:
        train.run(load_cfg(*TINY_RUN), paths)
    for needle in ("data/prepare/user_train.npz", "[1, 7, 7]", "'input' [batch, 1, 8, 8]", "data.input_shape"):
        assert needle in str(info.value), str(info.value)


@pytest.mark.parametrize("stage,missing", [(generate, "data/pretrain/base.onnx"), (train, "data/generate/training_model.onnx"),
                                            (evaluate, "data/generate/training_model.onnx"), (export, "data/generate/training_model.onnx")])
def test_missing_upstream_output_names_the_file(tmp_path, stage, missing):
    with pytest.raises(DataError, match=f"{missing}: .*dvc repro"):
        stage.run(load_cfg(*TINY_RUN), Paths(tmp_path))


def test_failing_stage_keeps_its_earlier_outputs(tiny_run, project, capsys):
    copy_outputs(tiny_run, project)
    before = {p.name: digest(p) for p in (project / "data" / "train").iterdir() if p.is_file()}
    assert train.main(["tracking=disabled", *TINY_RUN, "train.init_checkpoint=data/nope.ckpt"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert err[0].startswith("train: error: train.init_checkpoint=data/nope.ckpt")
    assert "Traceback" not in err[0]
    assert {p.name: digest(p) for p in (project / "data" / "train").iterdir() if p.is_file()} == before
    assert not [p for p in (project / "data").iterdir() if p.name.startswith(".")]  # no staging left behind


def test_checkpoints_and_differences_carry_no_timestamp(tiny_run):
    """Same inputs, same bytes: DVC sees a rerun as unchanged and a fresh clone
    reproduces dvc.lock (the tensor files' zip members carry the zip epoch)."""
    import zipfile

    files = [tiny_run.out("generate") / "checkpoint", tiny_run.out("generate") / "nominal_checkpoint", tiny_run.out("train") / "checkpoint",
             *(tiny_run.out("train") / "checkpoints").iterdir(), tiny_run.out("export") / "model.odtdiff"]
    for path in files:
        assert {i.date_time for i in zipfile.ZipFile(path).infolist()} == {(1980, 1, 1, 0, 0, 0)}, path


# --------------------------------------------------------------------------- evaluate, export


def test_evaluate_compares_base_and_personalized_on_both_sets(tiny_run):
    out = tiny_run.out("evaluate")
    m = json.loads((out / "metrics.json").read_text())
    holdout = load_npz(tiny_run.split("user_holdout"))
    assert m["user_holdout"]["n"] == len(holdout["y"])
    assert m["global_test"]["n"] == len(load_npz(tiny_run.split("global_test"))["y"])
    for split in ("user_holdout", "global_test"):
        for model in ("base", "personalized"):
            assert 0 <= m[split][model]["accuracy"] <= 1
            assert m[split][model]["loss"] > 0
    for model in ("base", "personalized"):
        rows = json.loads((out / f"confusion_{model}.json").read_text())
        assert [r["actual"] for r in rows] == holdout["y"].tolist()
        correct = np.mean([r["actual"] == r["predicted"] for r in rows])
        assert correct == pytest.approx(m["user_holdout"][model]["accuracy"])


def test_export_runs_on_onnxruntime_and_its_difference_applies(tiny_run):
    out = tiny_run.out("export")
    proto = onnx.load(out / "inference.onnx")
    onnx.checker.check_model(proto, full_check=True)
    assert proto.ir_version == 10
    assert [i.name for i in proto.graph.input] == ["input"]
    assert not proto.metadata_props
    x = load_npz(tiny_run.split("user_holdout"))["x"]
    sess = ort.InferenceSession(str(out / "inference.onnx"), providers=["CPUExecutionProvider"])
    theirs = sess.run(None, {"input": x})[0]
    import odt_ops

    (ours,) = odt_ops.InferenceSession(out / "inference.onnx").run(None, {"input": x})
    np.testing.assert_allclose(theirs, ours, atol=1e-5)
    acc = float((theirs.argmax(1) == load_npz(tiny_run.split("user_holdout"))["y"]).mean())
    assert acc == pytest.approx(json.loads((tiny_run.out("evaluate") / "metrics.json").read_text())["user_holdout"]["personalized"]["accuracy"])
    diff = load_diff(out / "model.odtdiff")
    assert sorted(diff.deltas) == ["head.bias", "head.weight"]
    assert diff.num_examples == 30
    assert diff.num_steps == 6
    restored = apply_diff(load_checkpoint(tiny_run.out("generate") / "checkpoint"), diff)
    trained = load_checkpoint(tiny_run.out("train") / "checkpoint")
    np.testing.assert_allclose(restored.parameters["head.weight"], trained.parameters["head.weight"], atol=1e-6)
    m = json.loads((out / "metrics.json").read_text())
    assert m["onnxruntime"]["checked"] == 1
    assert m["onnxruntime"]["argmax_agreement"] == 1.0


def test_export_ir_version_from_config(tiny_run, tmp_path):
    paths = copy_outputs(tiny_run, tmp_path, stages=("prepare", "generate", "train"))
    export.run(load_cfg("export.ir_version=11"), paths)
    assert onnx.load(paths.out("export") / "inference.onnx").ir_version == 11


def test_export_writes_the_web_bundle_of_generates_artifacts(tiny_run):
    """data/export/web holds generate's three model files byte for byte and the user's samples."""
    web = tiny_run.out("export") / "web"
    manifest = json.loads((web / "bundle.json").read_text())
    blob = (web / "bundle.bin").read_bytes()
    for entry in manifest["models"].values():
        original = (tiny_run.out("generate") / entry["file"]).read_bytes()
        assert blob[entry["offset"] : entry["offset"] + entry["bytes"]] == original
        assert entry["sha256"] == hashlib.sha256(original).hexdigest()
    y = load_npz(tiny_run.split("user_train"))["y"]
    assert manifest["samples"]["train"]["y"]["shape"] == [len(y)]
    assert json.loads((tiny_run.out("export") / "metrics.json").read_text())["web_bundle"]["bytes"] == len(blob)


def test_cnn_and_torch_sources_run_through_every_stage(tiny_run, tmp_path):
    """Conv, MaxPool and a PyTorch export train on the device and export like the MLP."""
    for model in ("cnn", "torch"):
        if model == "torch":
            pytest.importorskip("torch")
        paths = copy_outputs(tiny_run, tmp_path / model, stages=("prepare",))
        cfg = load_cfg(*TINY_RUN, f"model={model}")
        convert.run(cfg, paths)
        m = run_stages(cfg, paths)
        assert m["pretrain"]["trained"] == 1
        assert m["export"]["onnxruntime.checked"] == 1
        assert json.loads((paths.out("generate") / "artifacts.json").read_text())["trainable"] == ["head.weight", "head.bias"]


def _run_on(terminal: bool, args: list[str], env: dict) -> str:
    """Run a command with stdout and stderr on a pseudo-terminal (100 columns) or a pipe."""
    import fcntl
    import os
    import pty
    import select
    import struct
    import termios

    if not terminal:
        return subprocess.run(args, env=env, cwd=REPO, capture_output=True, text=True, timeout=120).stderr
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 30, 100, 0, 0))
    proc = subprocess.Popen(args, env=env, cwd=REPO, stdin=slave, stdout=slave, stderr=slave, close_fds=True)
    os.close(slave)
    out = b""
    while True:
        if select.select([master], [], [], 0.5)[0]:
            try:
                chunk = os.read(master, 65536)
            except OSError:
                break
            if not chunk:
                break
            out += chunk
        elif proc.poll() is not None:
            break
    proc.wait(timeout=60)
    os.close(master)
    return out.decode(errors="replace")


def test_progress_bar_on_a_terminal_only(tiny_run, tmp_path):
    import os

    root = copy_outputs(tiny_run, tmp_path, stages=("prepare", "generate")).root
    shutil.copytree(REPO / "conf", root / "conf")
    env = {**os.environ, "ODT_PROJECT_ROOT": str(root)}
    args = [sys.executable, "-m", "pipeline.train", "tracking=disabled", *TINY_RUN, "train.epochs=40"]
    shown = _run_on(True, args, env)
    assert "train:   0%|" in shown, shown
    assert "| 0/80 [" in shown, shown
    assert "step/s" in shown, shown  # 30 samples, batch 16: 80 steps
    quiet = _run_on(False, args, env)
    assert quiet.strip() == "", quiet
    assert "%|" not in quiet, quiet  # a pipe: no bar, no \r spam (the done line is on stdout)


def test_stage_modules_import_neither_torch_nor_mlflow():
    """A `dvc repro` with model!=torch never pays for torch; mlflow loads only to track."""
    code = ("import sys; import pipeline.pretrain, pipeline.generate, pipeline.train, pipeline.evaluate, pipeline.export, "
            "pipeline.retrain, pipeline.stage; print(sorted(m for m in ('torch', 'mlflow', 'sklearn', 'matplotlib') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120, check=True).stdout
    assert out.strip() == "[]"
