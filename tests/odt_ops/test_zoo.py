"""The onnx wheel's nine zoo networks load, normalize and run, matching onnxruntime."""
from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest

import odt_ops
from tests.odt_ops.zoo import ZOO_MODELS, randomize_weights, zoo_path


def test_all_nine_zoo_models_are_found():
    assert len(ZOO_MODELS) == 9, ZOO_MODELS


def _ort_run(proto: onnx.ModelProto, feeds):
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    sess = ort.InferenceSession(proto.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


@pytest.mark.parametrize("name", ZOO_MODELS)
def test_zoo_model_matches_onnxruntime(name):
    model = odt_ops.load_model(zoo_path(name))
    assert not any(n.op_type in ("Constant", "ConstantOfShape") for n in model.graph.node)
    _compare(model.proto, "shipped")
    # new weights in the same normalized graph
    _compare(randomize_weights(model.proto, seed=sum(map(ord, name))), "random")


def _compare(proto: onnx.ModelProto, weights: str) -> None:
    sess = odt_ops.InferenceSession(odt_ops.Model(proto, normalized=True))
    spec = sess.inputs[0]
    x = np.random.default_rng(1).standard_normal([1 if not isinstance(d, int) else d for d in spec.shape]).astype(np.float32)
    got = sess.run(None, {spec.name: x})
    want = _ort_run(proto, {spec.name: x})
    for g, w in zip(got, want):
        assert g.shape == w.shape
        assert g.dtype == w.dtype
        scale = float(np.max(np.abs(w)))
        assert float(np.max(np.abs(g - w))) <= 1e-4 * scale, f"max error {np.max(np.abs(g - w))} vs scale {scale}"
        if weights == "random":
            assert float(np.std(w)) > 0, "randomized weights must give non-uniform outputs"


def test_the_demo_compares_a_network_that_can_disagree(capsys, monkeypatch):
    """`odt demo` runs the zoo network with seeded weights: its output varies (the shipped weights'
    uniform output would let any engine agree), onnxruntime agrees with it, and a wrong output
    from our engine is caught."""
    from odt_ops.__main__ import main
    from odt_ops.runtime.session import InferenceSession

    outputs = []
    run = InferenceSession.run

    def recorded(self, names, feeds):
        result = run(self, names, feeds)
        outputs.append(result[0])
        return result

    monkeypatch.setattr(InferenceSession, "run", recorded)
    assert main(["demo"]) == 0
    assert "onnxruntime agrees" in capsys.readouterr().out
    (y,) = outputs
    assert np.std(y) > 0.01 * np.max(np.abs(y)), y.ravel()[:8]

    def off(self, names, feeds):
        (y,) = run(self, names, feeds)
        y = y.copy()
        y.flat[int(np.argmax(y))] *= 1.01  # one class score 1% off
        return [y]

    monkeypatch.setattr(InferenceSession, "run", off)
    assert main(["demo"]) == 1


def test_the_demo_names_the_models_it_has(capsys):
    from odt_ops.__main__ import main

    with pytest.raises(SystemExit) as exit_:
        main(["demo", "--model", "nosuch"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "invalid choice: 'nosuch'" in err and all(name in err for name in ZOO_MODELS), err
