"""Command line: ``python -m odt_ops check MODEL`` and ``python -m odt_ops demo``."""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

from odt_ops.errors import OdtError


def check(args: argparse.Namespace) -> int:
    """Load and normalize a model; report op coverage and parameter count."""
    from odt_ops.ir.load import load_model, read_model
    from odt_ops.ir.passes import require_kernels

    raw = read_model(args.model)
    print(f"{args.model}: opset {raw.opset}, {len(raw.graph.node)} nodes")
    model = load_model(raw)
    require_kernels(model)
    params = sum(int(np.prod(a.shape)) for a in model.initializer_arrays().values() if a.dtype.kind == "f")
    ops = sorted({n.op_type for n in model.graph.node})
    print(f"normalized: opset {model.opset}, {len(model.graph.node)} nodes, {params:,} float parameters")
    print(f"every op has a kernel: {', '.join(ops)}")
    return 0


def demo(args: argparse.Namespace) -> int:
    """Normalize a real network shipped with onnx and run it, side by side with onnxruntime."""
    import onnx

    from odt_ops.runtime.session import InferenceSession

    path = Path(onnx.__file__).parent / "backend" / "test" / "data" / "light" / f"light_{args.model}.onnx"
    t0 = time.perf_counter()
    sess = InferenceSession(path)
    load_s = time.perf_counter() - t0
    spec = sess.inputs[0]
    x = np.random.default_rng(0).standard_normal([d if isinstance(d, int) else 1 for d in spec.shape]).astype(np.float32)
    t0 = time.perf_counter()
    (y,) = sess.run(None, {spec.name: x})
    run_s = time.perf_counter() - t0
    print(f"{path.name}: loaded and normalized in {load_s:.2f} s ({len(sess.model.graph.node)} nodes, opset {sess.model.opset})")
    print(f"odt_ops forward: {run_s * 1000:.1f} ms, output {y.shape}")
    try:
        import onnxruntime as ort
    except ImportError:
        print("onnxruntime is not installed: no side-by-side comparison")
        return 0
    ref = ort.InferenceSession(sess.model.proto.SerializeToString(), providers=["CPUExecutionProvider"])
    (want,) = ref.run(None, {spec.name: x})
    err = float(np.max(np.abs(y - want)) / max(float(np.max(np.abs(want))), 1e-30))
    print(f"onnxruntime agrees: max error relative to the largest output {err:.2e}")
    return 0 if err < 1e-4 else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m odt_ops", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("check", help="load a model and report what the engine covers")
    p.add_argument("model", help="path to an .onnx file")
    p.set_defaults(func=check)
    p = sub.add_parser("demo", help="run a zoo network shipped with onnx and compare with onnxruntime")
    p.add_argument("--model", default="squeezenet", help="one of the onnx wheel's light zoo models (default: squeezenet)")
    p.set_defaults(func=demo)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except OdtError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
