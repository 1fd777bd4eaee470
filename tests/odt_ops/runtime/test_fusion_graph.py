"""The fusions' node list (runtime/fusion/graph.py): after every ``replace`` its producer and
consumer lookups, updated in place, are what ``ir.graph.producers``/``consumers`` rebuild from
the node list (same nodes, readers in node order), on the training plans of a batch-normalized
CNN, an MLP and the benchmark's MobileNetV3 (depthwise: every fusion family runs)."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from odt_ops import artifacts, meta
from odt_ops.ir.graph import consumers, producers
from odt_ops.runtime.fusion import graph as fusion_graph
from odt_ops.runtime.plan import Plan
from tests.odt_ops.models import cnn, mlp


def _mobilenet(directory) -> onnx.ModelProto:
    pytest.importorskip("torch", reason="PyTorch defines the benchmark's MobileNetV3")
    from odt_ops.benchmark import configs as cfgs

    return cfgs.forward_model(cfgs.CONFIGS["mobilenetv3-adamw"])


def _identities(lookup: dict) -> dict:
    return {name: [id(n) for n in nodes] if isinstance(nodes, list) else id(nodes) for name, nodes in lookup.items()}


@pytest.mark.parametrize("build", [lambda d: cnn(batchnorm=True), lambda d: mlp(), _mobilenet], ids=["cnn", "mlp", "mobilenetv3"])
def test_the_lookups_after_every_replace_are_those_rebuilt_from_the_nodes(tmp_path, monkeypatch, build):
    model = build(tmp_path)
    trainable = [t.name for t in model.graph.initializer if "running" not in t.name and t.data_type == onnx.TensorProto.FLOAT]
    artifacts.generate_artifacts(model, requires_grad=trainable, loss=artifacts.LossType.CrossEntropyLoss,
                                 artifact_directory=tmp_path)
    proto = onnx.load(tmp_path / "training_model.onnx")
    info = meta.read(proto)
    replaced = []
    reindex = fusion_graph.Graph._reindex

    def checked(self, old, new):
        reindex(self, old, new)
        replaced.append(new.op_type)
        assert _identities(self._producer) == _identities(producers(self.nodes)), new.name
        assert _identities(self._consumers) == _identities(consumers(self.nodes)), new.name

    monkeypatch.setattr(fusion_graph.Graph, "_reindex", checked)
    constants = {t.name: numpy_helper.to_array(t) for t in proto.graph.initializer}
    Plan(proto.graph, {o.domain: o.version for o in proto.opset_import}, constants,
         [*info.user_inputs, *info.labels, *info.parameters, *info.buffers],
         [info.loss, *(info.gradients[p] for p in info.trainable)], rng=np.random.default_rng(0))
    assert len(replaced) >= 3, replaced  # the fusions did rewrite this graph


def test_a_pass_taken_out_and_put_back_runs_in_its_place(monkeypatch):
    """fuse runs the passes in fusion.ORDER, not in FUSIONS' insertion order: a pass a test removes and
    monkeypatch puts back (at the dict's end) still runs before the passes that read its nodes."""
    from odt_ops.runtime import fusion

    with monkeypatch.context() as m:
        m.delitem(fusion.FUSIONS, "lstm_cell")
    assert list(fusion.FUSIONS)[-1] == "lstm_cell"  # what the undo did to the dict
    ran = []
    for name in list(fusion.FUSIONS):
        monkeypatch.setitem(fusion.FUSIONS, name, lambda g, name=name: ran.append(name))
    fusion.fuse([], {}, keep=[])
    assert ran == list(fusion.ORDER)
