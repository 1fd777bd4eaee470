"""convert: every source becomes a normalized model that odt_ops and onnxruntime run
alike, and a model that does not fit the data is stopped naming the file and input."""
from __future__ import annotations

import hashlib
import shutil
import sys

import numpy as np
import onnx
import pytest

import odt_ops
from pipeline import convert, models
from pipeline.errors import DataError, ModelSourceError
from pipeline.io import load_npz
from pipeline.paths import Paths
from tests.pipeline.conftest import load_cfg

ort = pytest.importorskip("onnxruntime")


@pytest.fixture
def paths(prepared, tmp_path) -> Paths:
    """A fresh root that shares the module's prepared data."""
    shutil.copytree(prepared.out("prepare"), tmp_path / "data" / "prepare")
    return Paths(tmp_path)


def user_samples(paths: Paths) -> np.ndarray:
    return load_npz(paths.split("user_train"))["x"][:32]


def ort_run(path, x: np.ndarray) -> np.ndarray:
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return sess.run(None, {sess.get_inputs()[0].name: x})[0]


@pytest.mark.parametrize("model", ["mlp", "cnn"])
def test_builtin_models_run_alike_in_odt_ops_and_onnxruntime(paths, model):
    metrics = convert.run(load_cfg(f"model={model}"), paths)
    path = paths.base_model
    proto = onnx.load(path)
    onnx.checker.check_model(proto, full_check=True)
    assert proto.opset_import[0].version == models.OPSET
    assert proto.ir_version <= 10
    assert proto.graph.input[0].type.tensor_type.shape.dim[0].dim_param  # symbolic batch
    x = user_samples(paths)
    (ours,) = odt_ops.InferenceSession(path).run(None, {"input": x})
    theirs = ort_run(path, x)
    assert ours.shape == (32, 10)
    np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-5)
    assert ours.std() > 0.1  # He init: the logits are not degenerate
    names = [t.name for t in proto.graph.initializer]
    assert names[-2:] == ["head.weight", "head.bias"] or {"head.weight", "head.bias"} <= set(names)
    assert metrics["n_params"] == sum(int(np.prod(t.dims)) for t in proto.graph.initializer)


def test_builtin_conversion_is_seeded(paths, tmp_path):
    other = Paths(tmp_path / "other")
    shutil.copytree(paths.out("prepare"), other.out("prepare"))
    convert.run(load_cfg("model=cnn"), paths)
    convert.run(load_cfg("model=cnn"), other)
    digest = lambda p: hashlib.sha256(p.base_model.read_bytes()).hexdigest()
    assert digest(paths) == digest(other)
    convert.run(load_cfg("model=cnn", "seed=3"), other)
    assert digest(paths) != digest(other)


def test_onnx_file_at_an_old_opset_is_normalized(paths):
    """An opset-9, IR-3 model that lists its initializers as graph inputs, as old exporters did."""
    old = models.mlp([1, 8, 8], 10, [16], seed=1)
    old.opset_import[0].version = 9
    old.ir_version = 3
    for t in old.graph.initializer:
        old.graph.input.append(onnx.helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)))
    onnx.checker.check_model(old)
    (paths.root / "data" / "models").mkdir(parents=True)
    onnx.save(old, paths.root / "data" / "models" / "old.onnx")
    convert.run(load_cfg("model=onnx_file", "model.path=data/models/old.onnx"), paths)
    proto = onnx.load(paths.base_model)
    assert proto.opset_import[0].version == 21
    x = user_samples(paths)
    np.testing.assert_allclose(ort_run(paths.base_model, x), ort_run(paths.root / "data/models/old.onnx", x), rtol=1e-5, atol=1e-5)


def test_zoo_model_that_does_not_fit_the_data_names_file_and_input(paths):
    with pytest.raises(DataError) as info:
        convert.run(load_cfg("model=onnx_file", "model.path=zoo:squeezenet"), paths)
    message = str(info.value)
    for needle in ("data/prepare/user_train.npz", "[1, 8, 8]", "'data_0'", "[batch, 3, 224, 224]", "data.input_shape"):
        assert needle in message, message


def test_model_with_the_wrong_number_of_classes(paths):
    onnx.save(models.mlp([1, 8, 8], 5, [], seed=0), paths.root / "five.onnx")
    with pytest.raises(ModelSourceError, match=r"expected \[8, 10\] class scores"):
        convert.run(load_cfg("model=onnx_file", "model.path=five.onnx"), paths)


@pytest.mark.parametrize(
    "overrides,needles",
    [
        (["model=onnx_file", "model.path=data/models/nope.onnx"], ["model.path=data/models/nope.onnx", "does not exist", "model=mlp"]),
        (["model=onnx_file", "model.path=zoo:nope"], ["zoo:nope", "squeezenet"]),
        (["model=torch", "model.torch_class=not_a_module_xyz:Net"], ["not_a_module_xyz", "cannot import"]),
    ],
)
def test_missing_model_sources_name_the_source_and_the_fix(paths, overrides, needles):
    if "model=torch" in overrides:
        pytest.importorskip("torch")
    with pytest.raises(ModelSourceError) as info:
        convert.run(load_cfg(*overrides), paths)
    for needle in needles:
        assert needle in str(info.value), str(info.value)


def test_corrupt_onnx_file_names_the_file(paths):
    (paths.root / "bad.onnx").write_bytes(b"\x08\x07garbage")
    with pytest.raises(odt_ops.OdtError, match="bad.onnx"):
        convert.run(load_cfg("model=onnx_file", "model.path=bad.onnx"), paths)


def test_missing_prepare_output_names_the_file(tmp_path):
    with pytest.raises(DataError, match=r"user_train.npz: prepare output not found"):
        convert.run(load_cfg(), Paths(tmp_path))


def test_torch_source_without_torch_says_how_to_fix(paths, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)  # import torch -> ImportError
    with pytest.raises(ModelSourceError, match="needs PyTorch.*pip install torch"):
        convert.run(load_cfg("model=torch"), paths)


def test_torch_module_by_import_path_matches_torch(paths):
    torch = pytest.importorskip("torch")
    convert.run(load_cfg("model=torch"), paths)
    x = user_samples(paths)
    from pipeline.torch_models import DigitsCNN

    torch.manual_seed(0)  # convert seeds torch with cfg.seed (0) before building
    with torch.no_grad():
        want = DigitsCNN()(torch.from_numpy(x)).numpy()
    (ours,) = odt_ops.InferenceSession(paths.base_model).run(None, {"input": x})
    np.testing.assert_allclose(ours, want, rtol=1e-4, atol=1e-5)
    assert "head.weight" in {t.name for t in onnx.load(paths.base_model).graph.initializer}
