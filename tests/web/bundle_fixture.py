"""A small web bundle for odt-web's tests: a digits classifier (8x8 -> 32 -> 10) whose head
trains, as the pipeline's personalization does, with slanted user digits and a holdout.

``python -m tests.web.bundle_fixture OUT [--page]`` writes it (web/'s Node tests call this).
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

from odt_ops import artifacts
from odt_ops.web_bundle import write_web_bundle

TRAINABLE = ["fc2.weight", "fc2.bias"]


def digits(n_train: int = 96, n_holdout: int = 64) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """scikit-learn's digits (shipped in its wheel), slanted as a user's hand (pipeline.datasets)."""
    from pipeline.datasets import load_digits_demo, render_style

    x, y = load_digits_demo()
    rng = np.random.default_rng(0)
    pick = rng.permutation(len(x))[: n_train + n_holdout]
    slanted = render_style(x[pick], slant_deg=22.0, stroke=1, jitter_deg=3.0, shift=(0.0, 0.0), rng=rng)
    return {"train": (slanted[:n_train], y[pick][:n_train]), "holdout": (slanted[n_train:], y[pick][n_train:])}


def classifier(seed: int = 0) -> onnx.ModelProto:
    rng = np.random.default_rng(seed)
    weights = [numpy_helper.from_array((rng.standard_normal(shape) * scale).astype(np.float32), name) for name, shape, scale in
               (("fc1.weight", (32, 64), 0.2), ("fc1.bias", (32,), 0.1), ("fc2.weight", (10, 32), 0.2), ("fc2.bias", (10,), 0.1))]
    nodes = [helper.make_node("Flatten", ["x"], ["flat"], axis=1),
             helper.make_node("Gemm", ["flat", "fc1.weight", "fc1.bias"], ["h"], transB=1),
             helper.make_node("Relu", ["h"], ["hr"]),
             helper.make_node("Gemm", ["hr", "fc2.weight", "fc2.bias"], ["logits"], transB=1)]
    graph = helper.make_graph(nodes, "digits", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["batch", 1, 8, 8])],
                              [helper.make_tensor_value_info("logits", onnx.TensorProto.FLOAT, ["batch", 10])], weights)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])


def make_artifacts(directory: Path) -> Path:
    artifacts.generate_artifacts(classifier(), requires_grad=TRAINABLE, frozen_params=["fc1.weight", "fc1.bias"],
                                 loss=artifacts.LossType.CrossEntropyLoss, optimizer=artifacts.OptimType.AdamW,
                                 artifact_directory=directory, additional_output_names=["logits"])
    return directory


def make_bundle(out: Path, *, page: bool = False) -> Path:
    """Artifacts under out/artifacts, samples under out/samples, the bundle (and page) in out/bundle."""
    out = Path(out)
    make_artifacts(out / "artifacts")
    samples = {}
    for name, (x, y) in digits().items():
        samples[name] = out / "samples" / f"{name}.npz"
        samples[name].parent.mkdir(parents=True, exist_ok=True)
        np.savez(samples[name], x=x, y=y)
    write_web_bundle(out / "artifacts", out / "bundle", samples=samples, page=page)
    return out / "bundle"


if __name__ == "__main__":
    print(make_bundle(Path(sys.argv[1]), page="--page" in sys.argv[2:]))
