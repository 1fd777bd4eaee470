"""Run one ONNX model on the three engines the artifacts promise to run on:
odt_ops' numpy engine, onnxruntime's ordinary inference build, onnx.reference."""
from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import onnx
import onnxruntime as ort
from onnx.reference import ReferenceEvaluator

import odt_ops


def run_odt(proto: onnx.ModelProto, feeds: Mapping[str, np.ndarray]) -> list[np.ndarray]:
    return odt_ops.InferenceSession(proto, normalize=False).run(None, dict(feeds))


def run_ort(proto: onnx.ModelProto, feeds: Mapping[str, np.ndarray]) -> list[np.ndarray]:
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    # no graph rewrites: run the artifact exactly as written
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(proto.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    return sess.run(None, dict(feeds))


def run_reference(proto: onnx.ModelProto, feeds: Mapping[str, np.ndarray]) -> list[np.ndarray]:
    return [np.asarray(x) for x in ReferenceEvaluator(proto).run(None, dict(feeds))]


ENGINES = {"odt": run_odt, "onnxruntime": run_ort, "reference": run_reference}


def run_all(proto: onnx.ModelProto, feeds: Mapping[str, np.ndarray]) -> dict[str, dict[str, np.ndarray]]:
    """engine -> output name -> value."""
    names = [o.name for o in proto.graph.output]
    return {engine: dict(zip(names, run(proto, feeds))) for engine, run in ENGINES.items()}
