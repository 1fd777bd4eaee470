"""Command line: ``python -m odt_ops check MODEL``, ``python -m odt_ops demo``,
``python -m odt_ops import-ort ORT_DIR OUT_DIR`` and ``python -m odt_ops export-web ARTIFACTS OUT``."""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

from odt_ops.domain import is_default
from odt_ops.errors import OdtError


def check(args: argparse.Namespace) -> int:
    """Load and normalize a model; report every node lacking a kernel or a gradient rule."""
    from odt_ops import coverage
    from odt_ops.artifacts import check_coverage, default_trainable
    from odt_ops.ir.load import load_model, read_model

    raw = read_model(args.model)
    print(f"{args.model}: opset {raw.opset}, {len(raw.graph.node)} nodes")
    model = load_model(raw)  # raises UnsupportedOpError listing every op without a kernel
    trainable = args.requires_grad or default_trainable(model)
    report = check_coverage(model, trainable)
    print(f"normalized: opset {model.opset}, {report['nodes']} nodes, {report['all_parameters']:,} float parameters")
    print(f"trainable: {report['trainable_parameters']:,} parameters in {len(trainable)} tensors")
    if report["missing"]:
        print("missing (domain::op, opset: nodes):")
        for (domain, op, opset), nodes in sorted(report["missing"].items()):
            print(f"  {domain or 'ai.onnx'}::{op}, opset {opset}: {', '.join(nodes[:8])}{' ...' if len(nodes) > 8 else ''}")
            why = coverage.reason(op) if is_default(domain) else None
            if why:
                print(f"      why: {why}")
        return 1
    print("every node has a kernel and every node on the path to a trainable parameter a gradient rule")
    return 0


def demo(args: argparse.Namespace) -> int:
    """Normalize a real network shipped with onnx, give it seeded weights (its own are one
    constant, whose uniform outputs any engine would match) and run it, side by side with onnxruntime."""
    from odt_ops.ir.load import load_model
    from odt_ops.ir.model import Model
    from odt_ops.runtime.session import InferenceSession
    from odt_ops.zoo import randomize_weights, zoo_path

    path = zoo_path(args.model)
    t0 = time.perf_counter()
    sess = InferenceSession(Model(randomize_weights(load_model(path).proto), normalized=True))
    load_s = time.perf_counter() - t0
    spec = sess.inputs[0]
    x = np.random.default_rng(0).standard_normal([d if isinstance(d, int) else 1 for d in spec.shape]).astype(np.float32)
    t0 = time.perf_counter()
    (y,) = sess.run(None, {spec.name: x})
    run_s = time.perf_counter() - t0
    print(f"{path.name}: loaded and normalized in {load_s:.2f} s ({len(sess.model.graph.node)} nodes, opset {sess.model.opset}; "
          "seeded He-normal weights: the shipped ones are one constant)")
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


def import_ort(args: argparse.Namespace) -> int:
    """Regenerate ONNX Runtime's training artifacts as ours, its checkpoint's values and optimizer state included."""
    from odt_ops.ort_import.artifacts import read_ort_artifacts, write_artifacts

    ort = read_ort_artifacts(args.ort_dir, args.checkpoint, args.prefix)
    ckpt = ort.checkpoint
    opt = ckpt.optimizer
    optimizer = ort.optimizer.kind if ort.optimizer else f"none (no {args.prefix}optimizer_model.onnx: an Optimizer needs one)"
    print(f"{args.ort_dir}: loss {ort.loss_kind} on {ort.loss_inputs}, optimizer "
          f"{optimizer}, {len(ort.trainable)} trainable and {len(ort.frozen)} frozen "
          f"parameters{' (nominal)' if ckpt.nominal else ''}"
          + (f", optimizer step {opt.step} at learning rate {opt.learning_rate:g}" if opt else ""))
    paths = write_artifacts(ort, args.out_dir, args.prefix)
    for kind, path in paths.items():
        print(f"  {kind}: {path}")
    return 0


def export_web(args: argparse.Namespace) -> int:
    """Write the artifacts as a web bundle (and the demo page) for training in a browser."""
    from odt_ops.web_bundle import BINARY, MANIFEST, write_web_bundle

    samples = dict(s.split("=", 1) for s in args.samples or [])
    manifest = write_web_bundle(args.artifacts, args.out, samples=samples, page=not args.no_page)
    n = sum(1 for t in manifest["tensors"] if t["kind"] == "parameter" and t["trainable"])
    print(f"{args.out}: {MANIFEST} + {BINARY} ({manifest['binary']['bytes']:,} bytes: 3 models, {len(manifest['tensors'])} tensors, "
          f"{n} trainable; samples {sorted(manifest['samples']) or 'none'})")
    if not args.no_page:
        print(f"serve it: python -m http.server -d {args.out} 8000, then open http://127.0.0.1:8000/")
    return 0


def _sample_set(text: str) -> str:
    if "=" not in text or not text.split("=", 1)[0]:
        raise argparse.ArgumentTypeError(f"{text!r}: write NAME=PATH.npz, e.g. train=data/prepare/user_train.npz")
    return text


def main(argv: list[str] | None = None) -> int:
    from odt_ops.zoo import zoo_models

    parser = argparse.ArgumentParser(prog=program_name(),
                                     description="ODT: on-device training from ONNX models (`odt` is `python -m odt_ops`).")
    parser.add_argument("--version", action="version", version=f"%(prog)s {version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("check", help="report every node lacking a kernel or a gradient rule, before generating anything")
    p.add_argument("model", help="path to an .onnx file")
    p.add_argument("--requires-grad", nargs="*", metavar="NAME_OR_GLOB", help="trainable parameters (default: every float initializer)")
    p.set_defaults(func=check)
    p = sub.add_parser("demo", help="run a zoo network shipped with onnx and compare with onnxruntime")
    p.add_argument("--model", default="squeezenet", choices=zoo_models(), help="one of the onnx wheel's zoo models (default: squeezenet)")
    p.set_defaults(func=demo)
    p = sub.add_parser("import-ort", help="turn an onnxruntime-training artifact directory and checkpoint into odt_ops artifacts")
    p.add_argument("ort_dir", help="directory with onnxruntime's eval_model.onnx, optimizer_model.onnx and checkpoint")
    p.add_argument("out_dir", help="directory to write the odt_ops artifacts and checkpoint to")
    p.add_argument("--checkpoint", help="onnxruntime checkpoint file to import (default: ORT_DIR/checkpoint)")
    p.add_argument("--prefix", default="", help="file name prefix of the artifacts (generate_artifacts' prefix)")
    p.set_defaults(func=import_ort)
    p = sub.add_parser("export-web", help="write the artifacts as a web bundle (JSON manifest + one binary) and the demo page")
    p.add_argument("artifacts", help="folder with training_model.onnx, eval_model.onnx, optimizer_model.onnx and checkpoint")
    p.add_argument("out", help="folder to write bundle.json, bundle.bin and the page to")
    p.add_argument("--samples", nargs="*", type=_sample_set, metavar="NAME=NPZ",
                   help="sample sets to bundle (.npz with x and y), e.g. train=data/prepare/user_train.npz holdout=data/prepare/user_holdout.npz")
    p.add_argument("--no-page", action="store_true", help="the bundle alone, without the demo page and onnxruntime-web's runtime")
    p.set_defaults(func=export_web)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except OdtError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # a path the system refuses (an output folder that is a file, no permission, a full disk)
        where = f"{exc.filename}: " if exc.filename else ""
        print(f"error: {where}{exc.strerror or exc}; choose a path you can read or write", file=sys.stderr)
        return 2


def program_name() -> str:
    """``odt`` (the console script) or ``python -m odt_ops``, as the user typed it."""
    name = Path(sys.argv[0]).name if sys.argv and sys.argv[0] else ""
    return "python -m odt_ops" if name in ("", "__main__.py", "-c") else name


def version() -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    try:
        return installed("odt")
    except PackageNotFoundError:  # a source tree that was never installed
        return "unknown (not installed)"


if __name__ == "__main__":
    sys.exit(main())
