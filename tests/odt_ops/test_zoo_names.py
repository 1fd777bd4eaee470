"""The onnx wheel's zoo models make weights as ConstantOfShape -> Reshape (or Unsqueeze): after
loading, each folded weight carries the name the file gives it (the ConstantOfShape output a
user reads in the file), holds the values onnxruntime computes for the reshaped value, and
``requires_grad=[that name]`` trains it."""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import numpy_helper

import odt_ops
from odt_ops import artifacts, meta
from tests.odt_ops.zoo import zoo_path

RESHAPING = ("Reshape", "Unsqueeze", "Squeeze", "Flatten")


def _reshaped_weights(raw: onnx.ModelProto) -> dict[str, str]:
    """{reshaping node's output: its ConstantOfShape-made input} in the file as shipped."""
    made = {o for n in raw.graph.node if n.op_type == "ConstantOfShape" for o in n.output}
    return {n.output[0]: n.input[0] for n in raw.graph.node if n.op_type in RESHAPING and n.input[0] in made}


@pytest.mark.parametrize("name", ["inception_v1", "inception_v2", "densenet121"])
def test_folded_weights_keep_the_names_in_the_file(name):
    raw = onnx.load(zoo_path(name))
    reshaped = _reshaped_weights(raw)
    assert reshaped, "the shipped model makes weights by ConstantOfShape -> Reshape/Unsqueeze"
    file_names = {o for n in raw.graph.node for o in n.output} | {t.name for t in raw.graph.initializer}
    model = odt_ops.load_model(zoo_path(name))
    weights = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer if t.data_type == onnx.TensorProto.FLOAT}
    assert not set(reshaped) & set(weights), "no weight is named after the Reshape that made it"
    # oracle: onnxruntime evaluates the reshaped values in the shipped file
    probe = onnx.ModelProto()
    probe.CopyFrom(raw)
    probe.graph.output.extend(onnx.helper.make_empty_tensor_value_info(o) for o in reshaped)
    session = ort.InferenceSession(probe.SerializeToString(), providers=["CPUExecutionProvider"])
    spec = session.get_inputs()[0]
    x = np.zeros([d if isinstance(d, int) else 1 for d in spec.shape], np.float32)
    values = dict(zip([o.name for o in session.get_outputs()], session.run(None, {spec.name: x})))
    for out, source in reshaped.items():
        assert source in weights, f"{out!r} (made from {source!r}) was stored under another name"
        np.testing.assert_array_equal(weights[source], values[out], err_msg=source)
    strays = [n for n, a in weights.items() if a.size > 1 and n not in file_names]
    assert not strays, f"weights under names the file never uses: {strays}"


def test_requires_grad_takes_the_name_in_the_file(tmp_path):
    artifacts.generate_artifacts(zoo_path("inception_v1"), requires_grad=["loss3/classifier_w_0", "loss3/classifier_b_0"],
                                 loss=artifacts.LossType.MSELoss, artifact_directory=tmp_path)
    training = onnx.load(tmp_path / "training_model.onnx")
    info = meta.read(training, "training_model.onnx")
    assert info.trainable == ["loss3/classifier_w_0", "loss3/classifier_b_0"]
    assert set(info.gradients) == set(info.trainable)
