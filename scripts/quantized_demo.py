"""The pipeline's demo, fine-tuned three ways: float, quantization-aware on its int8 QDQ
model, and LoRA on the frozen int8 base; accuracy on the user's holdout of each, and of the
re-quantized export as onnxruntime runs it.

    python scripts/quantized_demo.py [--epochs 20] [--workdir DIR]

It runs the pipeline's prepare, convert and pretrain stages (default configuration) in a
temporary root, quantizes the pretrained model with onnxruntime.quantization.quantize_static
(QDQ, per-channel int8, calibrated on 256 global training images), and trains on the user's
training digits with AdamW (lr 3e-3, batch 16), as the train stage does.
"""
from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np
import onnx


def _accuracy(logits: np.ndarray, y: np.ndarray) -> float:
    return float(np.mean(logits.argmax(axis=1) == y))


def _ort(path, x: np.ndarray) -> np.ndarray:
    import onnxruntime

    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return session.run(None, {session.get_inputs()[0].name: x})[0]


def _fine_tune(model, out: Path, train, epochs: int, **kwargs):
    from odt_ops import artifacts
    from odt_ops.api import CheckpointState, Module, Optimizer
    from odt_ops.onnxblock import optim

    paths = artifacts.generate_artifacts(model, loss=artifacts.LossType.CrossEntropyLoss, optimizer=optim.AdamW(mode="torch", weight_decay=0.01),
                                         artifact_directory=out, **kwargs)
    state = CheckpointState.load_checkpoint(paths["checkpoint"])
    module = Module(paths["training_model"], state, paths["eval_model"])
    opt = Optimizer(paths["optimizer_model"], module)
    opt.set_learning_rate(3e-3)
    rng = np.random.default_rng(0)
    module.train()
    for _ in range(epochs):
        order = rng.permutation(len(train.y))
        for i in range(0, len(order), 16):
            batch = order[i:i + 16]
            module.lazy_reset_grad()
            module(train.x[batch], train.y[batch])
            opt.step()
    module.eval()
    module.export_model_for_inferencing(out / "engine.onnx")
    return paths, state


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--workdir", type=Path, default=None)
    args = p.parse_args(argv)
    from onnxruntime import quantization

    from odt_ops import InferenceSession
    from odt_ops.lora import LoraConfig, export_merged
    from odt_ops.quant.export import export_quantized
    from pipeline import config, convert, inputs, prepare, pretrain
    from pipeline.paths import Paths

    root = args.workdir or Path(tempfile.mkdtemp(prefix="odt-quantized-demo-"))
    paths = Paths(root)
    cfg = config.load(["tracking=disabled"])
    for stage in (prepare, convert, pretrain):
        stage.run(cfg, paths)
    train, holdout, calibration = (inputs.load_split(paths, n) for n in ("user_train", "user_holdout", "global_train"))
    base = onnx.load(str(paths.pretrained_model))
    name = base.graph.input[0].name

    class Calibration(quantization.CalibrationDataReader):
        def __init__(self):
            self.batches = iter([{name: calibration.x[i:i + 32]} for i in range(0, 256, 32)])

        def get_next(self):
            return next(self.batches, None)

    qdq_path = root / "base_qdq.onnx"
    quantization.quantize_static(str(paths.pretrained_model), str(qdq_path), Calibration(), quant_format=quantization.QuantFormat.QDQ,
                                 per_channel=True, activation_type=quantization.QuantType.QInt8, weight_type=quantization.QuantType.QInt8)
    rows = [("float base", _accuracy(_ort(paths.pretrained_model, holdout.x), holdout.y)),
            ("int8 QDQ base (onnxruntime)", _accuracy(_ort(qdq_path, holdout.x), holdout.y))]

    float_params = [t.name for t in base.graph.initializer if t.data_type == onnx.TensorProto.FLOAT]
    _fine_tune(base, _fresh(root / "float"), train, args.epochs, requires_grad=float_params)
    rows.append(("float fine-tune (odt_ops)", _accuracy(InferenceSession(str(root / "float" / "engine.onnx")).run(None, {name: holdout.x})[0], holdout.y)))

    qat_paths, qat_state = _fine_tune(str(qdq_path), _fresh(root / "qat"), train, args.epochs, qat=True)
    rows.append(("QAT fine-tune (odt_ops, fake-quant)", _accuracy(InferenceSession(str(root / "qat" / "engine.onnx")).run(None, {name: holdout.x})[0], holdout.y)))
    export_quantized(qat_paths["eval_model"], qat_state.checkpoint, root / "qat" / "requantized.onnx")
    rows.append(("QAT re-quantized export (onnxruntime)", _accuracy(_ort(root / "qat" / "requantized.onnx", holdout.x), holdout.y)))

    lora_paths, lora_state = _fine_tune(str(qdq_path), _fresh(root / "qlora"), train, args.epochs,
                                        lora=LoraConfig(rank=4, alpha=8, targets=["Gemm", "MatMul"]))
    rows.append(("LoRA on the frozen int8 base (odt_ops)",
                 _accuracy(InferenceSession(str(root / "qlora" / "engine.onnx")).run(None, {name: holdout.x})[0], holdout.y)))
    export_merged(lora_paths["eval_model"], lora_state.checkpoint, root / "qlora" / "merged.onnx")
    rows.append(("LoRA merged, re-quantized (onnxruntime)", _accuracy(_ort(root / "qlora" / "merged.onnx", holdout.x), holdout.y)))
    print(f"user holdout accuracy ({len(holdout.y)} digits), {args.epochs} epochs on {len(train.y)} user digits; work in {root}")
    for label, acc in rows:
        print(f"  {label:42s} {acc:.3f}")
    return 0


def _fresh(directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    return directory


if __name__ == "__main__":
    raise SystemExit(main())
