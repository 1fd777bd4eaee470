"""Each untyped error of issue 20, made on purpose: the file is damaged the way the issue lists and
used as a user would; the answer must be an odt_ops error naming the file.

The oracles are the libraries that refuse the damage themselves (numpy's PCG64 rejects the
generator states, onnx.checker the swapped op, protobuf the truncated bytes, json the deep
nesting): each test first shows that the raw library call raises something untyped, then that
our reader turns it into our error."""
from __future__ import annotations

import json
import shutil

import numpy as np
import onnx
import pytest

from odt_ops.api import CheckpointState, Module, Optimizer
from odt_ops.errors import ArtifactError, CheckpointError, ModelCheckError, ModelLoadError, OdtError
from tests.odt_ops.fuzz import originals, zipcraft


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    return originals.build(tmp_path_factory.mktemp("originals"))


@pytest.fixture
def folder(made, tmp_path):
    d = tmp_path / "case"
    shutil.copytree(made, d)
    return d


def _use(d, checkpoint: str = "trained"):
    state = CheckpointState.load_checkpoint(d / checkpoint)
    module = Module(d / "training_model.onnx", state, d / "eval_model.onnx")
    if checkpoint == "nominal_checkpoint":
        module.copy_buffer_to_parameters(np.zeros(module.get_parameters_size(False), np.float32), trainable_only=False)
    optimizer = Optimizer(d / "optimizer_model.onnx", module)
    module(*originals.batch())
    optimizer.step()


def _edit_manifest(path, change) -> None:
    members = zipcraft.read_members(path.read_bytes())
    manifest = json.loads(next(m.data for m in members if m.name == "manifest.json"))
    change(manifest)
    path.write_bytes(zipcraft.build([zipcraft.Member(m.name, json.dumps(manifest).encode()) if m.name == "manifest.json" else m
                                     for m in members]))


def _raises_ours(error, path, use) -> None:
    with pytest.raises(error) as info:
        use()
    assert str(path) in str(info.value), info.value


BAD_STATES = ['{"bit_generator": "PCG64"}', "[]", "nope",
              '{"bit_generator": "PCG64", "state": {"state": "x", "inc": 1}, "has_uint32": 0, "uinteger": 0}',
              '{"bit_generator": "MT19937", "state": {"key": [1], "pos": 0}}',
              '{"bit_generator": "PCG64", "state": {"state": -1, "inc": 2}, "has_uint32": 0, "uinteger": 0}']


@pytest.mark.parametrize("checkpoint", ["trained", "nominal_checkpoint"])
@pytest.mark.parametrize("state", BAD_STATES)
def test_a_damaged_generator_state_is_a_checkpoint_error(folder, checkpoint, state):
    with pytest.raises(Exception) as raw:  # the oracle: numpy refuses it, with one of five builtin errors
        np.random.PCG64().state = json.loads(state)
    assert not isinstance(raw.value, OdtError)
    _edit_manifest(folder / checkpoint, lambda m: m["engine"].__setitem__("rng_state", state))
    _raises_ours(CheckpointError, folder / checkpoint, lambda: _use(folder, checkpoint))


@pytest.mark.parametrize("change", ["shape", "dtype", "orphan"])
def test_optimizer_state_of_the_wrong_shape_or_dtype_is_a_checkpoint_error(folder, change):
    import io

    path = folder / "trained"
    members = zipcraft.read_members(path.read_bytes())
    manifest = json.loads(next(m.data for m in members if m.name == "manifest.json"))
    entry = next(e for e in manifest["tensors"] if e["kind"] == "optimizer")
    array = np.zeros(entry["shape"], entry["dtype"])
    if change == "shape":
        array = np.zeros([d + 1 for d in entry["shape"]], entry["dtype"])
    elif change == "dtype":
        array = array.astype(np.complex64)
    else:
        entry["name"] = "fc9.weight"
    buf = io.BytesIO()
    np.lib.format.write_array(buf, array)
    entry["shape"], entry["dtype"] = list(array.shape), array.dtype.str
    path.write_bytes(zipcraft.build([zipcraft.Member(m.name, json.dumps(manifest).encode()) if m.name == "manifest.json"
                                     else zipcraft.Member(m.name, buf.getvalue()) if m.name == entry["key"] + ".npy" else m
                                     for m in members]))
    _raises_ours(CheckpointError, path, lambda: _use(folder))


def _edit_model(path, change) -> None:
    model = onnx.load(path)
    change(model)
    path.write_bytes(model.SerializeToString())


def _artifact_meta(change):
    def edit(model):
        prop = next(p for p in model.metadata_props if p.key == "odt.artifact")
        data = json.loads(prop.value)
        change(data)
        prop.value = json.dumps(data)
    return edit


def test_a_parameter_the_training_model_lacks_is_an_artifact_error(folder):
    _edit_model(folder / "training_model.onnx", _artifact_meta(lambda d: d["trainable"].append("fc9.weight")))
    _raises_ours(ArtifactError, folder / "training_model.onnx", lambda: _use(folder))


def test_deep_json_in_the_artifact_metadata_is_an_artifact_error(folder):
    deep = "[" * 100_000 + "]" * 100_000
    with pytest.raises(RecursionError):  # the oracle: json gives up on it
        json.loads(deep)
    _edit_model(folder / "training_model.onnx", lambda m: setattr(next(p for p in m.metadata_props if p.key == "odt.artifact"),
                                                                   "value", deep))
    _raises_ours(ArtifactError, folder / "training_model.onnx", lambda: _use(folder))


@pytest.mark.parametrize("target", ["training_model.onnx", "eval_model.onnx"])
@pytest.mark.parametrize("change", ["swap op", "retype attribute", "invalid element type", "initializer size"])
def test_a_damaged_artifact_graph_fails_on_load_naming_the_file(folder, target, change):
    def edit(model):
        graph = model.graph
        if change == "swap op":  # a two-input node turned into Relu: the fusion once hit an IndexError on it
            next(n for n in graph.node if n.op_type == "Gemm").op_type = "Relu"
        elif change == "retype attribute":
            attr = next(a for n in graph.node if n.op_type == "Gemm" for a in n.attribute if a.name == "transB")
            attr.type = onnx.AttributeProto.FLOAT
        elif change == "invalid element type":
            graph.input[0].type.tensor_type.elem_type = 999
        else:
            graph.initializer.append(onnx.TensorProto(name="bad", data_type=onnx.TensorProto.FLOAT, dims=[4], raw_data=b"\0" * 7))
    _edit_model(folder / target, edit)
    raw = onnx.load(folder / target)
    if change != "initializer size":
        with pytest.raises(Exception) as oracle:  # onnx.checker refuses the damaged graph itself
            onnx.checker.check_model(raw, full_check=True)
        assert not isinstance(oracle.value, OdtError)
        _raises_ours(OdtError, folder / target, lambda: _use(folder))
    else:
        with pytest.raises(ValueError):  # the oracle: onnx cannot read 7 bytes as float32[4]
            onnx.numpy_helper.to_array(raw.graph.initializer[-1])
        _raises_ours(OdtError, folder / target, lambda: _use(folder))


@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_an_unreadable_onnx_file_is_a_model_load_error_naming_it(folder, damage):
    path = folder / "training_model.onnx"
    data = path.read_bytes()
    data = data[: len(data) // 3] if damage == "truncated" else bytes(np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8))
    path.write_bytes(data)
    with pytest.raises(Exception) as oracle:  # protobuf refuses the bytes
        onnx.ModelProto().ParseFromString(data)
    assert not isinstance(oracle.value, OdtError)
    _raises_ours(ModelLoadError, path, lambda: _use(folder))


def test_a_string_tensor_that_is_not_utf8_is_a_model_load_error(folder):
    path = folder / "training_model.onnx"
    bad = onnx.TensorProto(name="labels_text", data_type=onnx.TensorProto.STRING, dims=[1], string_data=[b"\xff\xfe"])
    _edit_model(path, lambda m: m.graph.initializer.append(bad))
    with pytest.raises(UnicodeDecodeError):  # the oracle: onnx's own conversion
        onnx.numpy_helper.to_array(bad)
    _raises_ours(ModelLoadError, path, lambda: _use(folder))


def test_a_diff_with_negative_counts_is_refused_naming_it(folder):
    from odt_ops.errors import ModelDiffError
    from odt_ops.export import load_diff

    _edit_manifest(folder / "update.odtdiff", lambda m: m.__setitem__("num_examples", -(2**63)))
    _raises_ours(ModelDiffError, folder / "update.odtdiff", lambda: load_diff(folder / "update.odtdiff"))


def test_module_checks_do_not_refuse_the_real_artifacts(folder):
    _use(folder)
    _use(folder, "nominal_checkpoint")


def test_model_check_error_is_what_a_swapped_op_in_a_forward_model_gives(folder):
    import odt_ops

    _edit_model(folder / "forward.onnx", lambda m: setattr(m.graph.node[0], "op_type", "Relu"))
    _raises_ours(ModelCheckError, folder / "forward.onnx", lambda: odt_ops.load_model(folder / "forward.onnx"))
