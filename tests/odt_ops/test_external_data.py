"""External tensor data of an untrusted model is read only from regular files inside its folder.

The oracle for "was a file outside the folder read" is the interpreter's own audit events
(every open is reported before it happens, tests/odt_ops/fuzz/watch.py), not our code's say.
The path-traversal cases are those onnx's loader was fixed for (CVE-2022-25882 and
CVE-2024-27318: ``..`` parts, absolute paths, traversal after a normal prefix) plus symlinks,
which a ``..`` check alone does not catch."""
from __future__ import annotations

import os

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper
from onnx.reference import ReferenceEvaluator

import odt_ops
from odt_ops import artifacts
from odt_ops.api import CheckpointState, Module
from odt_ops.errors import ModelLoadError
from odt_ops.ir.load import HEAVY_BYTES, read_model
from tests.odt_ops.fuzz.watch import outside, watching

SECRET = np.arange(64 * 3, dtype=np.float32)  # what an attacker would like to read: the bytes of a file outside


def _model_with_external(folder, location: str, *, extra: dict[str, str] | None = None, count: int = 64 * 3) -> onnx.ModelProto:
    """y = x @ w with w [64, 3] (or ``count`` floats) stored externally at ``location``."""
    w = onnx.TensorProto(name="w", data_type=onnx.TensorProto.FLOAT, dims=[count // 3, 3])
    w.data_location = onnx.TensorProto.EXTERNAL
    for key, value in {"location": location, "offset": "0", "length": str(count * 4), **(extra or {})}.items():
        w.external_data.add(key=key, value=value)
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["batch", count // 3])],
                              [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["batch", 3])], [w])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)
    (folder / "model.onnx").write_bytes(model.SerializeToString())
    return model


@pytest.fixture
def layout(tmp_path):
    """tmp/model (the model's folder) and tmp/outside/secret.bin (a file the model must not reach)."""
    folder, out = tmp_path / "model", tmp_path / "outside"
    folder.mkdir()
    out.mkdir()
    SECRET.tofile(out / "secret.bin")
    return folder, out


def _load_refused(folder, match: str) -> None:
    with watching() as opened, pytest.raises(ModelLoadError, match=match) as info:
        odt_ops.load_model(folder / "model.onnx").initializer_arrays()
    assert str(folder / "model.onnx") in str(info.value)
    assert not outside(opened, folder), f"read outside the model's folder: {outside(opened, folder)}"


def test_a_symlink_leading_out_of_the_folder_is_refused_unread(layout):
    folder, out = layout
    os.symlink(out / "secret.bin", folder / "weights.bin")
    _model_with_external(folder, "weights.bin")
    _load_refused(folder, "leads outside the folder")


def test_a_path_through_a_symlinked_sub_folder_is_refused_unread(layout):
    folder, out = layout
    os.symlink(out, folder / "sub")
    _model_with_external(folder, "sub/secret.bin")
    _load_refused(folder, "leads outside the folder")


def test_a_symlink_that_stays_inside_the_folder_is_read(layout):
    folder, _ = layout
    (folder / "data").mkdir()
    SECRET.tofile(folder / "data" / "w.bin")
    os.symlink(folder / "data" / "w.bin", folder / "w.bin")
    _model_with_external(folder, "w.bin")
    with watching() as opened:
        arrays = odt_ops.load_model(folder / "model.onnx").initializer_arrays()
    np.testing.assert_array_equal(arrays["w"].ravel(), SECRET)
    assert not outside(opened, folder)


@pytest.mark.parametrize("location", ["../outside/secret.bin", "./../outside/secret.bin", "data/../../outside/secret.bin",
                                      "ABSOLUTE", "data\\..\\..\\outside\\secret.bin", "w.bin\0.txt"])
def test_onnx_path_traversal_cases_are_refused_unread(layout, location):
    folder, out = layout
    (folder / "data").mkdir()
    _model_with_external(folder, str(out / "secret.bin") if location == "ABSOLUTE" else location)
    _load_refused(folder, "unsafe location")


@pytest.mark.parametrize("kind", ["directory", "fifo", "device"])
def test_directories_devices_and_fifos_are_refused(layout, kind):
    folder, _ = layout
    target = folder / "w.bin"
    if kind == "directory":
        target.mkdir()
    elif kind == "fifo":
        os.mkfifo(target)  # opening it for reading without O_NONBLOCK would hang the process
    else:
        os.symlink("/dev/zero", target)
    _model_with_external(folder, "w.bin")
    _load_refused(folder, "not a regular file" if kind != "device" else "leads outside the folder")


@pytest.mark.parametrize("dims", [[0, 2**63 - 1], [2**40, 0, 2**40]], ids=["0x2**63-1", "2**40x0x2**40"])
def test_an_empty_external_tensor_with_a_huge_dimension_is_a_model_load_error(layout, dims):
    """It holds no bytes, so length 0 and an empty data file agree with it; numpy cannot make even an
    empty array of that shape ("array is too big"), which used to escape from Module and load_model."""
    folder, _ = layout
    (folder / "w.bin").write_bytes(b"")
    w = onnx.TensorProto(name="w", data_type=onnx.TensorProto.FLOAT, dims=dims)
    w.data_location = onnx.TensorProto.EXTERNAL
    for key, value in {"location": "w.bin", "offset": "0", "length": "0"}.items():
        w.external_data.add(key=key, value=value)
    graph = helper.make_graph([helper.make_node("Identity", ["w"], ["y"])], "g", [],
                              [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)], [w])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)
    (folder / "model.onnx").write_bytes(model.SerializeToString())
    _load_refused(folder, r"tensor 'w': shape \[.*\] of float32 spans more than 2\*\*40 bytes \(it holds no values, yet numpy "
                          "cannot even make it empty\); no real tensor is that large: the file is damaged")


@pytest.mark.parametrize("key,value", [("offset", "abc"), ("offset", "-4"), ("offset", "1e3"), ("offset", "9" * 30),
                                       ("length", "12"), ("length", "x"), ("offset", "4")])
def test_bad_offsets_and_lengths_are_model_load_errors(layout, key, value):
    folder, _ = layout
    SECRET.tofile(folder / "w.bin")
    _model_with_external(folder, "w.bin", extra={key: value})
    _load_refused(folder, "external data|too short")


def test_model_bytes_with_external_data_need_a_folder(layout, monkeypatch):
    """Bytes have no folder: the relative location must not be looked up in the working directory."""
    folder, out = layout
    model = _model_with_external(folder, "secret.bin")
    monkeypatch.chdir(out)  # the working directory holds a file of that name
    for source in (model.SerializeToString(), model):
        with watching() as opened, pytest.raises(ModelLoadError, match="base_dir"):
            read_model(source).initializer_arrays()
        assert not any(os.path.realpath(p).startswith(str(out)) for p in opened), opened
    SECRET.tofile(folder / "secret.bin")
    arrays = read_model(model.SerializeToString(), base_dir=folder).initializer_arrays()
    np.testing.assert_array_equal(arrays["w"].ravel(), SECRET)


def test_large_external_tensors_stay_memory_mapped_and_compute_like_onnx(layout):
    folder, _ = layout
    rows = HEAVY_BYTES // 12 + 1  # [rows, 3] float32 is past the size that is copied into the model
    w = np.random.default_rng(0).standard_normal((rows, 3)).astype(np.float32)
    w.tofile(folder / "w.bin")
    _model_with_external(folder, "w.bin", count=rows * 3)
    model = odt_ops.load_model(folder / "model.onnx")
    assert isinstance(model.initializer_arrays()["w"], np.memmap)
    x = np.random.default_rng(1).standard_normal((2, rows)).astype(np.float32)
    reference = onnx.load(folder / "model.onnx")  # onnx's loader as the oracle, on a safe model
    expected = ReferenceEvaluator(reference).run(None, {"x": x})[0]
    np.testing.assert_allclose(odt_ops.InferenceSession(model).run(None, {"x": x})[0], expected, rtol=1e-5, atol=1e-5)


def test_an_artifact_constant_with_external_data_is_not_read_from_the_working_directory(tmp_path, monkeypatch):
    """Module compiles the training model's constants itself; onnx's to_array would look the
    location up in the working directory."""
    from tests.odt_ops.models import mlp

    d, decoy = tmp_path / "artifacts", tmp_path / "cwd"
    decoy.mkdir()
    artifacts.generate_artifacts(mlp((6, 5, 3)), requires_grad=["fc*"], loss=artifacts.LossType.CrossEntropyLoss,
                               optimizer=artifacts.OptimType.AdamW, artifact_directory=d, opset=21)
    proto = onnx.load(d / "training_model.onnx")
    big = np.ones(HEAVY_BYTES // 4 + 1, np.float32)
    tensor = numpy_helper.from_array(big, "unused_constant")
    onnx.external_data_helper.set_external_data(tensor, "const.bin")
    tensor.ClearField("raw_data")
    tensor.data_location = onnx.TensorProto.EXTERNAL
    proto.graph.initializer.append(tensor)
    onnx.save(proto, d / "training_model.onnx")
    big.tofile(decoy / "const.bin")  # only in the working directory, not beside the model
    monkeypatch.chdir(decoy)
    state = CheckpointState.load_checkpoint(d / "checkpoint")
    with watching() as opened, pytest.raises(ModelLoadError, match="const.bin"):
        Module(d / "training_model.onnx", state, d / "eval_model.onnx")
    assert not outside(opened, d), outside(opened, d)


def test_module_refuses_an_empty_external_constant_with_a_huge_dimension(tmp_path):
    from tests.odt_ops.models import mlp

    d = tmp_path / "artifacts"
    artifacts.generate_artifacts(mlp((6, 5, 3)), requires_grad=["fc*"], loss=artifacts.LossType.CrossEntropyLoss,
                               optimizer=artifacts.OptimType.AdamW, artifact_directory=d, opset=21)
    proto = onnx.load(d / "training_model.onnx")
    tensor = onnx.TensorProto(name="empty_constant", data_type=onnx.TensorProto.FLOAT, dims=[0, 2**63 - 1])
    tensor.data_location = onnx.TensorProto.EXTERNAL
    for key, value in {"location": "empty.bin", "offset": "0", "length": "0"}.items():
        tensor.external_data.add(key=key, value=value)
    proto.graph.initializer.append(tensor)
    onnx.save(proto, d / "training_model.onnx")
    (d / "empty.bin").write_bytes(b"")
    state = CheckpointState.load_checkpoint(d / "checkpoint")
    with pytest.raises(ModelLoadError) as info:
        Module(d / "training_model.onnx", state, d / "eval_model.onnx")
    assert str(info.value) == (f"{d / 'training_model.onnx'}: tensor 'empty_constant': shape [0, {2**63 - 1}] of float32 spans "
                               "more than 2**40 bytes (it holds no values, yet numpy cannot even make it empty); no real "
                               "tensor is that large: the file is damaged")


@pytest.mark.parametrize("kind", ["symlink out", "directory"])
def test_an_onnx_runtime_checkpoint_reads_its_data_file_only_from_its_folder(tmp_path, kind):
    """ONNX Runtime's checkpoint keeps large tensors in ``checkpoint.data`` beside it."""
    import shutil

    from odt_ops.checkpoint import load_checkpoint
    from odt_ops.errors import CheckpointError

    fixtures = os.path.join(os.path.dirname(__file__), "..", "fixtures", "ort", "mlp_external")
    folder, out = tmp_path / "device", tmp_path / "elsewhere"
    folder.mkdir()
    out.mkdir()
    shutil.copy(os.path.join(fixtures, "checkpoint"), folder / "checkpoint")
    if kind == "symlink out":
        shutil.copy(os.path.join(fixtures, "checkpoint.data"), out / "secret.data")  # readable, right size: only the path is wrong
        os.symlink(out / "secret.data", folder / "checkpoint.data")
    else:
        (folder / "checkpoint.data").mkdir()
    with watching() as opened, pytest.raises(CheckpointError, match="checkpoint"):
        load_checkpoint(folder / "checkpoint")
    assert not outside(opened, folder), outside(opened, folder)


def test_import_ort_reads_eval_model_external_data_only_from_its_folder(tmp_path):
    """import-ort read ONNX Runtime's eval model with onnx.load; now with our reader."""
    import shutil

    from odt_ops.ort_import.artifacts import read_ort_artifacts

    fixtures = os.path.join(os.path.dirname(__file__), "..", "fixtures", "ort", "mlp")
    folder, out = tmp_path / "ort", tmp_path / "elsewhere"
    shutil.copytree(fixtures, folder)
    out.mkdir()
    proto = onnx.load(folder / "eval_model.onnx")  # parameters are its inputs: give it a constant to keep outside
    proto.graph.initializer.append(numpy_helper.from_array(np.arange(16, dtype=np.float32), "unused_constant"))
    onnx.save(proto, out / "eval_model.onnx", save_as_external_data=True, location="eval.data", size_threshold=0)
    os.symlink(out / "eval.data", folder / "eval.data")  # the data is readable and right: only its place is wrong
    shutil.copy(out / "eval_model.onnx", folder / "eval_model.onnx")
    with watching() as opened, pytest.raises(ModelLoadError, match="leads outside the folder"):
        read_ort_artifacts(folder)
    assert not outside(opened, folder), outside(opened, folder)
    os.unlink(folder / "eval.data")
    shutil.copy(out / "eval.data", folder / "eval.data")
    assert read_ort_artifacts(folder).trainable  # the same files inside the folder import
