"""Misuse of the training api surfaces as our typed errors, naming what to fix (not as an
AttributeError or TypeError from inside the Module)."""
from __future__ import annotations

import onnx
import pytest

from odt_ops import artifacts
from odt_ops.api import CheckpointState, Module
from odt_ops.errors import ArtifactError, InputError
from tests.odt_ops.models import mlp


@pytest.fixture(scope="module")
def small_artifacts(tmp_path_factory):
    d = tmp_path_factory.mktemp("small")
    artifacts.generate_artifacts(mlp((8, 4, 3)), requires_grad=["fc*"], loss=artifacts.LossType.CrossEntropyLoss,
                                 optimizer=artifacts.OptimType.SGD, artifact_directory=d)
    return d


def test_parameter_with_a_symbolic_dimension_is_refused_by_name(small_artifacts, tmp_path):
    # a checkpoint holds one array per parameter, so the training graph must fix its shape
    # (ONNX's dim_param marks a dimension as symbolic)
    proto = onnx.load(small_artifacts / "training_model.onnx")
    weight = next(v for v in proto.graph.input if v.name == "fc0.weight")
    weight.type.tensor_type.shape.dim[0].dim_param = "rows"
    onnx.save(proto, tmp_path / "training_model.onnx")
    state = CheckpointState.load_checkpoint(small_artifacts / "checkpoint")
    with pytest.raises(ArtifactError, match=r"'fc0.weight' has the shape \['rows', 8\]"):
        Module(tmp_path / "training_model.onnx", state)


def test_input_names_in_eval_mode_without_an_eval_model(small_artifacts):
    module = Module(small_artifacts / "training_model.onnx", CheckpointState.load_checkpoint(small_artifacts / "checkpoint"))
    assert module.train(False) is module  # onnxruntime's train(False) switches to eval mode
    with pytest.raises(InputError, match="no eval model; pass eval_model_uri"):
        module.input_names()
