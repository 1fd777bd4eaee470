"""Importing ONNX Runtime's on-device training state: its checkpoint file and artifact directory.

The fixtures (tests/fixtures/ort/, written by scripts/make_ort_fixtures.py with
onnxruntime-training 1.19.2, which CI does not have) hold ONNX Runtime's artifacts, the
checkpoint it saved after a few steps, and what it did when it resumed from that
checkpoint: the batches, losses, eval loss and final parameters. Our import, trained on
the same batches, must do the same to float32 rounding.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shutil
import struct
import subprocess
import sys
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from odt_ops.__main__ import main
from odt_ops.api import CheckpointState, Module, Optimizer
from odt_ops.checkpoint import load_checkpoint
from odt_ops.checkpoint.flatbuffer import Buffer
from odt_ops.checkpoint.ort import is_ort_checkpoint, parse_ort_checkpoint, read_ort_checkpoint
from odt_ops.errors import ArtifactError, CheckpointError
from odt_ops.ort_import.artifacts import import_ort_artifacts, read_ort_artifacts
from tests.odt_ops.test_checkpoint import deadline

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "ort"
NAMES = ("mlp", "cnn", "mlp_external")
RTOL, ATOL = 1e-5, 1e-7


def expected(name: str) -> tuple[dict, dict[str, np.ndarray]]:
    info = json.loads((FIXTURES / name / "expected.json").read_text())
    with np.load(FIXTURES / name / "expected.npz", allow_pickle=False) as npz:
        arrays = {k: npz[k] for k in npz.files}
    return info, arrays


def prefixed(arrays: dict[str, np.ndarray], prefix: str) -> dict[str, np.ndarray]:
    return {k[len(prefix):]: v for k, v in arrays.items() if k.startswith(prefix)}


# ------------------------------------------------------------------------------------------- the checkpoint reader


@pytest.mark.parametrize("name", NAMES)
def test_reader_gives_onnxruntimes_parameters_and_optimizer_state(name):
    info, arrays = expected(name)
    path = FIXTURES / name / "checkpoint"
    assert is_ort_checkpoint(path)
    ckpt = read_ort_checkpoint(path)
    saved = prefixed(arrays, "saved/")
    assert sorted(ckpt.parameters) == sorted(saved)
    for n, want in saved.items():
        np.testing.assert_array_equal(ckpt.parameters[n], want, err_msg=n)
        assert ckpt.parameters[n].dtype == want.dtype
    assert not ckpt.nominal
    opt = ckpt.optimizer
    assert opt.step == info.get("warmup_steps", 4)
    assert opt.learning_rate == opt.initial_learning_rate == pytest.approx(info["resumed_learning_rate"])
    trainable = sorted(n for n, grad in ckpt.requires_grad.items() if grad)
    assert sorted(opt.states) == trainable
    if "trainable" in info:
        assert trainable == sorted(info["trainable"])
        assert sorted(n for n, grad in ckpt.requires_grad.items() if not grad) == sorted(info["frozen"])
    for param, states in opt.states.items():
        names = {"exp_avg", "exp_avg_sq"} if info["optimizer"] == "AdamW" else {"momentum0"}
        assert set(states) == names, param
        for array in states.values():
            assert array.shape == ckpt.parameters[param].shape


def test_checkpoint_state_loads_onnxruntime_checkpoints_as_they_are():
    """CheckpointState.load_checkpoint takes ONNX Runtime's file itself, as ported code passes it."""
    _, arrays = expected("mlp")
    state = CheckpointState.load_checkpoint(FIXTURES / "mlp" / "checkpoint")
    for name, parameter in state.parameters:
        np.testing.assert_array_equal(parameter.data, prefixed(arrays, "saved/")[name], err_msg=name)
    assert dict(state.properties) == {"epoch": 2, "best_accuracy": 0.75, "run": "fixture"}


def test_reader_reads_the_property_bag():
    info, _ = expected("mlp")
    props = read_ort_checkpoint(FIXTURES / "mlp" / "checkpoint").properties
    assert props == info["properties"] == {"epoch": 2, "best_accuracy": 0.75, "run": "fixture"}
    assert isinstance(props["epoch"], int)
    assert isinstance(props["best_accuracy"], float)


def test_external_data_reads_as_the_same_checkpoint(tmp_path):
    inline = read_ort_checkpoint(FIXTURES / "mlp" / "checkpoint")
    external = read_ort_checkpoint(FIXTURES / "mlp_external" / "checkpoint")
    assert external.parameters.keys() == inline.parameters.keys()
    for n in inline.parameters:
        np.testing.assert_array_equal(external.parameters[n], inline.parameters[n])
        for s, a in inline.optimizer.states[n].items() if n in inline.optimizer.states else ():
            np.testing.assert_array_equal(external.optimizer.states[n][s], a)
    # without its .data file, or with a short one, the checkpoint cannot be read
    shutil.copy(FIXTURES / "mlp_external" / "checkpoint", tmp_path / "checkpoint")
    with pytest.raises(CheckpointError, match="external data file"):
        read_ort_checkpoint(tmp_path / "checkpoint")
    data = (FIXTURES / "mlp_external" / "checkpoint.data").read_bytes()
    (tmp_path / "checkpoint.data").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="past the end"):
        read_ort_checkpoint(tmp_path / "checkpoint")


def test_nominal_checkpoint_reads_as_nominal():
    _, arrays = expected("mlp")
    saved = prefixed(arrays, "saved/")
    path = FIXTURES / "mlp" / "nominal_checkpoint"
    ckpt = read_ort_checkpoint(path)
    assert ckpt.nominal
    assert ckpt.missing == set(saved)
    assert all(a.size == 0 for a in ckpt.parameters.values())
    # ONNX Runtime writes nominal tensors without shapes; the eval model's inputs give them
    ckpt = read_ort_artifacts(FIXTURES / "mlp", checkpoint=path).checkpoint
    for n, want in saved.items():
        assert ckpt.spec(n) == (want.shape, want.dtype)
    assert ckpt.optimizer is None


def test_import_of_a_nominal_checkpoint_is_nominal(tmp_path):
    _, arrays = expected("mlp")
    assert main(["import-ort", str(FIXTURES / "mlp"), str(tmp_path), "--checkpoint", str(FIXTURES / "mlp" / "nominal_checkpoint")]) == 0
    ours = load_checkpoint(tmp_path / "checkpoint")
    assert ours.nominal
    saved = prefixed(arrays, "saved/")
    for n, want in saved.items():
        assert ours.spec(n) == (want.shape, want.dtype)
    # filled with the trained values, as ONNX Runtime's nominal checkpoints are, it computes ONNX Runtime's loss
    info, _ = expected("mlp")
    state = CheckpointState.load_checkpoint(str(tmp_path / "checkpoint"))
    module = Module(str(tmp_path / "training_model.onnx"), state, str(tmp_path / "eval_model.onnx"))
    order = [n for n in ours.parameters if ours.requires_grad[n]] + [n for n in ours.parameters if not ours.requires_grad[n]]
    module.copy_buffer_to_parameters(np.concatenate([saved[n].ravel() for n in order]), trainable_only=False)
    module.train()
    np.testing.assert_allclose(_loss(module(arrays["batch0.x"], arrays["batch0.y"])), info["losses"][0], rtol=RTOL)


def test_a_checkpoint_of_other_artifacts_is_refused(tmp_path):
    with pytest.raises(ArtifactError, match="not inputs of"):
        read_ort_artifacts(FIXTURES / "mlp", checkpoint=FIXTURES / "cnn" / "checkpoint")
    import onnx

    shutil.copytree(FIXTURES / "losses" / "MSELoss", tmp_path / "ort")
    model = onnx.load(str(tmp_path / "ort" / "eval_model.onnx"))
    next(i for i in model.graph.input if i.name == "fc.weight").type.tensor_type.shape.dim[0].dim_value = 4
    onnx.save(model, str(tmp_path / "ort" / "eval_model.onnx"))
    with pytest.raises(CheckpointError, match=r"fc.weight: checkpoint has float32\[3, 5\], the model needs float32\[4, 5\]"):
        read_ort_artifacts(tmp_path / "ort")


def test_reader_errors_name_the_file(tmp_path):
    with pytest.raises(CheckpointError, match="nowhere"):
        read_ort_checkpoint(tmp_path / "nowhere")
    with pytest.raises(CheckpointError, match="a directory"):
        read_ort_checkpoint(tmp_path)
    ours = tmp_path / "ours"
    shutil.copy(FIXTURES / "mlp" / "checkpoint", ours)
    data = bytearray(ours.read_bytes())
    data[4:8] = b"ORTM"
    ours.write_bytes(bytes(data))
    assert not is_ort_checkpoint(ours)
    with pytest.raises(CheckpointError, match=rf"{ours}.*identifier"):
        read_ort_checkpoint(ours)


# ------------------------------------------------------------------------------------------- damaged files


def _variants(data: bytes, seed: int, count: int):
    """Truncations, flipped bytes, a wrong identifier, spliced garbage: every kind of damage
    a file copied off a device may have, seeded so a failure reproduces."""
    rng = np.random.default_rng(seed)
    for i in range(count):
        kind = i % 5
        b = bytearray(data)
        if kind == 0:
            yield "truncated", bytes(b[: int(rng.integers(0, len(b)))])
        elif kind == 1:
            for pos in rng.integers(0, len(b), int(rng.integers(1, 5))):
                b[pos] ^= int(rng.integers(1, 256))
            yield "flipped", bytes(b)
        elif kind == 2:
            b[4 + int(rng.integers(0, 4))] ^= int(rng.integers(1, 256))
            yield "identifier", bytes(b)
        elif kind == 3:  # a damaged offset or length word: the likeliest way to point out of bounds
            pos = int(rng.integers(0, len(b) - 4)) & ~3
            b[pos : pos + 4] = int(rng.integers(0, 2**32)).to_bytes(4, "little")
            yield "word", bytes(b)
        else:
            pos = int(rng.integers(0, len(b)))
            yield "spliced", bytes(b[:pos] + rng.bytes(int(rng.integers(1, 64)) * 4) + b[pos:])


@pytest.mark.parametrize("name", ["mlp/checkpoint", "cnn/checkpoint", "mlp/nominal_checkpoint", "mlp_external/checkpoint"])
def test_damaged_checkpoints_raise_checkpoint_error_only(name):
    path = FIXTURES / name
    data = path.read_bytes()
    external = path.with_name(path.name + ".data")
    raised = {}
    for i, (kind, damaged) in enumerate(_variants(data, seed=len(name), count=300)):
        try:
            parse_ort_checkpoint(damaged, f"variant{i}", external_data=external if external.exists() else None)
        except CheckpointError as exc:
            assert f"variant{i}" in str(exc)
            raised[kind] = raised.get(kind, 0) + 1
            continue
        except Exception as exc:
            pytest.fail(f"{name} variant {i} ({kind}) raised {type(exc).__name__}: {exc}")
        assert kind not in ("truncated", "identifier"), f"{name} variant {i} ({kind}) was read as a checkpoint"
    assert raised.get("truncated") == raised.get("identifier") == 60


def test_damaged_external_data_is_a_checkpoint_error(tmp_path):
    shutil.copy(FIXTURES / "mlp_external" / "checkpoint", tmp_path / "checkpoint")
    (tmp_path / "checkpoint.data").write_bytes(b"")
    with pytest.raises(CheckpointError, match="checkpoint.data"):
        read_ort_checkpoint(tmp_path / "checkpoint")


# ------------------------------------------------------------------------------------------- import-ort


def _loss(result) -> float:
    """A Module call's loss: its only output, or the first when there are additional outputs."""
    return float(result[0] if isinstance(result, (list, tuple)) else result)


def _continue_training(out: Path, arrays: dict[str, np.ndarray], steps: int):
    state = CheckpointState.load_checkpoint(str(out / "checkpoint"))
    module = Module(str(out / "training_model.onnx"), state, str(out / "eval_model.onnx"))
    optimizer = Optimizer(str(out / "optimizer_model.onnx"), module)
    module.train()
    losses = []
    for i in range(steps):
        losses.append(_loss(module(arrays[f"batch{i}.x"], arrays[f"batch{i}.y"])))
        optimizer.step()
        module.lazy_reset_grad()
    module.eval()
    eval_loss = _loss(module(arrays["eval.x"], arrays["eval.y"]))
    return state, optimizer, losses, eval_loss


@pytest.mark.parametrize("name", NAMES)
def test_import_ort_continues_where_onnxruntime_stopped(name, tmp_path, capsys):
    info, arrays = expected(name)
    assert main(["import-ort", str(FIXTURES / name), str(tmp_path)]) == 0
    assert info["loss"] in capsys.readouterr().out
    state, optimizer, losses, eval_loss = _continue_training(tmp_path, arrays, info["steps"])
    assert optimizer.optimizer.kind == info["optimizer"]
    assert optimizer.get_learning_rate() == pytest.approx(info["resumed_learning_rate"])
    np.testing.assert_allclose(losses, info["losses"], rtol=RTOL)
    np.testing.assert_allclose(eval_loss, info["eval_loss"], rtol=RTOL)
    ckpt = state.checkpoint
    final = prefixed(arrays, "final/")
    assert sorted([*ckpt.parameters, *ckpt.buffers]) == sorted(final)
    for n, want in final.items():
        got = ckpt.parameters.get(n, ckpt.buffers.get(n))
        np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL, err_msg=n)
    # the parameters moved: the comparison is not of the checkpoint with itself
    saved = prefixed(arrays, "saved/")
    assert any(not np.array_equal(saved[n], final[n]) for n in final)
    assert ckpt.optimizer.step == info.get("warmup_steps", 4) + info["steps"]


def test_additional_outputs_stay_outputs(tmp_path):
    info, arrays = expected("cnn")
    ort = read_ort_artifacts(FIXTURES / "cnn")
    assert ort.additional_outputs == info["additional_outputs"] == ["output"]
    import_ort_artifacts(FIXTURES / "cnn", tmp_path)
    state = CheckpointState.load_checkpoint(str(tmp_path / "checkpoint"))
    module = Module(str(tmp_path / "training_model.onnx"), state, str(tmp_path / "eval_model.onnx"))
    module.eval()
    loss, logits = module(arrays["eval.x"], arrays["eval.y"])
    assert logits.shape == (len(arrays["eval.x"]), 3)
    np.testing.assert_allclose(loss, np.mean((logits - arrays["eval.y"]) ** 2), rtol=RTOL)


@pytest.mark.parametrize("kind", ["MSELoss", "L1Loss", "BCEWithLogitsLoss", "CrossEntropyLoss"])
def test_each_onnxruntime_loss_is_recognised_and_computes_the_same(kind, tmp_path):
    directory = FIXTURES / "losses" / kind
    info = json.loads((directory / "expected.json").read_text())
    with np.load(directory / "expected.npz", allow_pickle=False) as npz:
        arrays = {k: npz[k] for k in npz.files}
    ort = read_ort_artifacts(directory)
    assert ort.loss_kind == kind
    assert ort.loss_inputs == ["output"]
    import_ort_artifacts(directory, tmp_path)
    state = CheckpointState.load_checkpoint(str(tmp_path / "checkpoint"))
    module = Module(str(tmp_path / "training_model.onnx"), state, str(tmp_path / "eval_model.onnx"))
    optimizer = Optimizer(str(tmp_path / "optimizer_model.onnx"), module)
    module.eval()
    np.testing.assert_allclose(_loss(module(arrays["x"], arrays["y"])), info["eval_loss"], rtol=RTOL)
    module.train()
    np.testing.assert_allclose(_loss(module(arrays["x"], arrays["y"])), info["train_loss"], rtol=RTOL)
    optimizer.set_learning_rate(0.5)  # as the fixture's one step
    optimizer.step()
    for n, want in prefixed(arrays, "final/").items():  # the loss's gradient is ONNX Runtime's
        np.testing.assert_allclose(state.checkpoint.parameters[n], want, rtol=RTOL, atol=ATOL, err_msg=n)


def test_import_keeps_names_loss_optimizer_and_properties(tmp_path):
    info, _ = expected("mlp")
    ort = read_ort_artifacts(FIXTURES / "mlp")
    assert ort.loss_kind == "CrossEntropyLoss"
    assert ort.loss_inputs == ["output"]
    assert sorted(ort.trainable) == sorted(info["trainable"])
    assert ort.frozen == info["frozen"]
    hp = info["hyperparameters"]
    opt = ort.optimizer
    assert opt.kind == "AdamW"
    assert opt.mode == "ort"
    np.testing.assert_allclose([*opt.betas, opt.eps, opt.weight_decay, opt.max_norm],
                               [*hp["betas"], hp["eps"], hp["weight_decay"], hp["max_norm"]], rtol=1e-6)
    assert read_ort_artifacts(FIXTURES / "cnn").loss_kind == "MSELoss"
    import_ort_artifacts(FIXTURES / "mlp", tmp_path)
    ours = load_checkpoint(tmp_path / "checkpoint")
    assert ours.properties == info["properties"]
    assert [n for n in ours.parameters if ours.requires_grad[n]] == sorted(info["trainable"])


def test_import_refuses_what_it_cannot_carry_over(tmp_path):
    import onnx

    ort_dir = tmp_path / "ort"
    shutil.copytree(FIXTURES / "mlp", ort_dir)
    model = onnx.load(str(ort_dir / "optimizer_model.onnx"))
    for node in model.graph.node:
        if node.op_type == "AdamWOptimizer":
            node.op_type = "LambOptimizer"
    onnx.save(model, str(ort_dir / "optimizer_model.onnx"))
    with pytest.raises(ArtifactError, match="LambOptimizer"):
        read_ort_artifacts(ort_dir)
    for node in model.graph.node:
        if node.op_type == "LambOptimizer":
            node.op_type = "AdamWOptimizer"
            next(a for a in node.attribute if a.name == "correct_bias").i = 0
    onnx.save(model, str(ort_dir / "optimizer_model.onnx"))
    with pytest.raises(ArtifactError, match="correct_bias"):
        read_ort_artifacts(ort_dir)
    assert main(["import-ort", str(tmp_path / "missing"), str(tmp_path / "out")]) == 2


def test_cli_without_an_optimizer_model_says_so_and_a_refused_output_path_is_one_line(tmp_path, capsys):
    """ONNX Runtime's generate_artifacts writes no optimizer model when given no optimizer: the
    import then says there is none, and what needs one; an output path the system refuses (a file
    is there) is one line naming it."""
    ort_dir = tmp_path / "ort"
    shutil.copytree(FIXTURES / "mlp", ort_dir)
    (ort_dir / "optimizer_model.onnx").unlink()
    assert main(["import-ort", str(ort_dir), str(tmp_path / "out")]) == 0
    assert "optimizer none (no optimizer_model.onnx: an Optimizer needs one)" in capsys.readouterr().out
    assert not (tmp_path / "out" / "optimizer_model.onnx").exists()
    (tmp_path / "a_file").write_text("mine")
    assert main(["import-ort", str(FIXTURES / "mlp"), str(tmp_path / "a_file")]) == 2
    assert capsys.readouterr().err.splitlines() == [f"error: {tmp_path / 'a_file'}: File exists; choose a path you can read or write"]
    assert (tmp_path / "a_file").read_text() == "mine"


def test_engine_reads_onnxruntime_checkpoints_without_the_flatbuffers_package():
    code = ("import sys; sys.modules['flatbuffers'] = None; sys.modules['onnxruntime'] = None\n"
            "from odt_ops.checkpoint.ort import read_ort_checkpoint\n"
            f"print(sorted(read_ort_checkpoint({str(FIXTURES / 'mlp' / 'checkpoint')!r}).parameters))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "fc1.weight" in out


def test_ort_adamw_moments_take_our_adamw_state_names():
    """The ORT reader names ONNX Runtime's AdamW moments without building an optimizer; the
    names must stay AdamW's own, in order (first moment, second moment)."""
    from odt_ops.checkpoint.ort import ORT_STATE_NAMES
    from odt_ops.onnxblock import optim

    assert list(ORT_STATE_NAMES) == ["momentum0", "momentum1"]
    assert tuple(ORT_STATE_NAMES.values()) == optim.AdamW().state_names


# ------------------------------------------------------------------------------------------- hostile checkpoint paths and fields


@contextlib.contextmanager
def bounded_memory(limit: int):
    tracemalloc.start()
    try:
        yield
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < limit, f"allocated {peak >> 20} MiB"


def _cap_memory() -> None:
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))


def _cli_error(argv, capsys) -> str:
    """The one line `odt import-ort` prints for a refused input (exit status 2, no traceback)."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and "Traceback" not in err, err
    return err[len("error: "):].rstrip("\n")


@pytest.mark.parametrize("kind", ["fifo", "symlink to /dev/zero", "3 GiB file"])
def test_a_fifo_a_device_or_an_oversized_checkpoint_is_refused_unread(tmp_path, kind, capsys):
    """import-ort hung on a FIFO named checkpoint and read /dev/zero until memory ran out (2.69 GB,
    then a MemoryError traceback): the checkpoint is opened only as a regular file, its size checked
    before it is read."""
    ort_dir = tmp_path / "ort"
    shutil.copytree(FIXTURES / "mlp", ort_dir)
    ckpt = ort_dir / "checkpoint"
    if kind == "fifo":
        ckpt.unlink()
        os.mkfifo(ckpt)
        says = f"{ckpt}: a FIFO (named pipe), not a regular file: refused unread; give the path of the ONNX Runtime checkpoint file itself"
    elif kind == "symlink to /dev/zero":
        ckpt.unlink()
        os.symlink("/dev/zero", ckpt)
        says = f"{ckpt}: a character device, not a regular file: refused unread; give the path of the ONNX Runtime checkpoint file itself"
    else:  # a real ONNX Runtime header, then a hole: sparse, so it takes no disk
        os.truncate(ckpt, 3 << 30)
        says = (f"{ckpt}: {3 << 30} bytes, more than an ONNX Runtime checkpoint can hold (2147483647, FlatBuffers' limit; "
                "larger ones keep their tensors in a .data file); refused unread")
    # first as the audit ran it, in a process of its own with its memory capped: were the file read,
    # /dev/zero would end only when memory runs out
    proc = subprocess.run([sys.executable, "-m", "odt_ops", "import-ort", str(ort_dir), str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=120, preexec_fn=_cap_memory,
                          env={**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"})  # few thread arenas
    assert (proc.returncode, proc.stderr) == (2, f"error: {says}\n")
    with deadline(30), bounded_memory(32 << 20):
        assert not is_ort_checkpoint(ckpt) or kind == "3 GiB file"
        with pytest.raises(CheckpointError) as info:
            read_ort_checkpoint(ckpt)
        assert str(info.value) == says
        with pytest.raises(CheckpointError) as info:
            CheckpointState.load_checkpoint(ckpt)
        assert str(ckpt) in str(info.value) and "refused unread" in str(info.value)
        assert _cli_error(["import-ort", str(ort_dir), str(tmp_path / "out")], capsys) == says
        assert _cli_error(["import-ort", str(FIXTURES / "mlp"), str(tmp_path / "out"), "--checkpoint", str(ckpt)], capsys) == says
    assert not (tmp_path / "out").exists()


def _patched(tmp_path, patch, name: str = "mlp") -> Path:
    """A copy of a fixture's artifact folder whose checkpoint bytes ``patch`` edited in place, as
    with a hex editor: it gets the bytes and the checkpoint's root table, to find where a field lies."""
    ort_dir = tmp_path / "ort"
    shutil.copytree(FIXTURES / name, ort_dir)
    data = bytearray((ort_dir / "checkpoint").read_bytes())
    patch(data, Buffer(bytes(data)).root())
    (ort_dir / "checkpoint").write_bytes(bytes(data))
    return ort_dir


def _set_group_scalar(field: str, value):
    def patch(data: bytearray, root) -> None:
        (group,) = root.tables(2, "optimizer_groups")
        index, fmt = {"step": (1, "<q"), "initial_learning_rate": (2, "<f")}[field]
        pos = group._field(index, struct.calcsize(fmt), field)
        assert pos is not None, f"the fixture stores no {field}"
        struct.pack_into(fmt, data, pos, value)
    return patch


@pytest.mark.parametrize("field,value,says", [
    ("step", -5, "the optimizer group's step is -5; a step count is >= 0"),
    ("initial_learning_rate", math.nan, "the optimizer group's initial_learning_rate is nan; a learning rate is a finite number >= 0"),
    ("initial_learning_rate", math.inf, "the optimizer group's initial_learning_rate is inf; a learning rate is a finite number >= 0"),
    ("initial_learning_rate", -0.5, "the optimizer group's initial_learning_rate is -0.5; a learning rate is a finite number >= 0"),
])
def test_bad_optimizer_scalars_in_an_onnx_runtime_checkpoint_are_refused(tmp_path, field, value, says, capsys):
    ort_dir = _patched(tmp_path, _set_group_scalar(field, value))
    ckpt = ort_dir / "checkpoint"
    want = f"{ckpt}: not a valid ONNX Runtime checkpoint: {says}"
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(ckpt)
    assert str(info.value) == want
    assert _cli_error(["import-ort", str(ort_dir), str(tmp_path / "out")], capsys) == want
    assert not (tmp_path / "out").exists()


def test_a_zero_learning_rate_in_an_onnx_runtime_checkpoint_is_read(tmp_path):
    ort_dir = _patched(tmp_path, _set_group_scalar("initial_learning_rate", 0.0))
    assert load_checkpoint(ort_dir / "checkpoint").optimizer.learning_rate == 0.0


def test_an_empty_onnx_runtime_tensor_with_a_huge_dimension_is_refused(tmp_path, capsys):
    """dims [0, 2**63 - 1] and no raw bytes: the byte count agrees (0), and numpy cannot make the array."""
    patched: dict[str, str] = {}

    def patch(data: bytearray, root) -> None:
        params = root.table(1, "module_state").tables(0, "requires_grad_params")
        tensor = next(t for t in params if len(t.int64s(2, "dims")) == 2)
        dims, _ = tensor._vector(2, "dims", 8)
        struct.pack_into("<qq", data, dims, 0, 2**63 - 1)
        raw, _ = tensor._vector(4, "raw_data", 1)
        struct.pack_into("<I", data, raw - 4, 0)  # the vector's length word: no bytes
        patched["name"] = tensor.string(0, "name")

    ort_dir = _patched(tmp_path, patch)
    ckpt = ort_dir / "checkpoint"
    want = (f"{ckpt}: not a valid ONNX Runtime checkpoint: tensor {patched['name']!r}: shape [0, {2**63 - 1}] of float32 spans "
            "more than 2**40 bytes (it holds no values, yet numpy cannot even make it empty); no real tensor is that large: "
            "the file is damaged")
    with deadline(30), bounded_memory(32 << 20):
        with pytest.raises(CheckpointError) as info:
            CheckpointState.load_checkpoint(ckpt)
        assert str(info.value) == want
        assert _cli_error(["import-ort", str(ort_dir), str(tmp_path / "out")], capsys) == want


@pytest.mark.parametrize("kind", ["symlink out", "fifo"])
def test_a_refused_data_file_is_said_once(tmp_path, kind, capsys):
    """The reader's own CheckpointError (a .data file leading out of the folder, or a FIFO) was
    wrapped again: "not a valid ONNX Runtime checkpoint: CheckpointError: <the same file>: ..."."""
    ort_dir = tmp_path / "ort"
    shutil.copytree(FIXTURES / "mlp_external", ort_dir)
    data = ort_dir / "checkpoint.data"
    data.unlink()
    if kind == "symlink out":
        (tmp_path / "elsewhere").write_bytes((FIXTURES / "mlp_external" / "checkpoint.data").read_bytes())
        os.symlink(tmp_path / "elsewhere", data)
        tail = f"location 'checkpoint.data' leads outside the folder {ort_dir} (through a symlink); refusing to read it"
    else:
        os.mkfifo(data)
        tail = f"{str(data)!r} is a FIFO (named pipe), not a regular file; refusing to read it"
    with deadline(30):
        text = _cli_error(["import-ort", str(ort_dir), str(tmp_path / "out")], capsys)
    assert re.fullmatch(rf"{re.escape(str(ort_dir / 'checkpoint'))}: tensor '[^']+' is stored in the external data file "
                        rf"{re.escape(str(data))}: {re.escape(tail)}", text), text
    assert "CheckpointError" not in text and "not a valid" not in text
