"""convert: the model source to one normalized, forward-only ONNX model.

Sources (``model.source``):

- ``builtin``: an MLP or a small CNN (``model.arch``) built for ``data.input_shape``
  and ``data.num_classes`` (pipeline/models.py), seeded by ``seed``;
- ``onnx``: any ONNX file (``model.path``, relative to the repository; old opsets are
  converted) or ``zoo:<name>``, a network the onnx wheel ships;
- ``torch``: a PyTorch module by import path (``model.torch_class``
  "package.module:Class", built with ``model.torch_kwargs``), exported to ONNX here;
  needs torch installed.

odt_ops.load_model normalizes the result (opset 21, folded constants, symbolic batch
dimension, unique names, every op has a kernel). The model is then run by
odt_ops.InferenceSession on samples of the user's data, so a model that does not fit
the data (input shape, number of classes) fails here, naming the data file.

Outputs (data/convert/): ``base.onnx``, ``model.json`` (inputs, outputs, parameters).
"""
from __future__ import annotations

import importlib
import inspect
import io
import sys
import warnings
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

import numpy as np
import onnx

import odt_ops
from pipeline import models
from pipeline.config import MISSING, Section
from pipeline.errors import DataError, ModelSourceError
from pipeline.io import load_npz, write_digests, write_json
from pipeline.paths import Paths
from pipeline.tracking import NO_TRACKING, NullRun

ZOO_DIR = Path(onnx.__file__).parent / "backend" / "test" / "data" / "light"
SAMPLE = 8  # samples run through the model to check it fits the data


class ModelSource(Enum):
    builtin = "builtin"
    onnx = "onnx"
    torch = "torch"


class Arch(Enum):
    mlp = "mlp"
    cnn = "cnn"


@dataclass
class ModelConfig(Section):
    """Each conf/model option sets ``source`` and the keys of that source; the others stay
    null (not applicable, not defaults)."""

    source: ModelSource = MISSING
    arch: Arch | None = None
    hidden: list[int] | None = None
    channels: list[int] | None = None
    kernel_size: int | None = None
    path: str | None = None
    torch_class: str | None = None
    torch_kwargs: dict[str, Any] | None = None

    def check(self) -> None:
        if self.source is ModelSource.builtin:
            self.need(self.arch is not None, "arch", f"one of {', '.join(a.value for a in Arch)} when model.source=builtin")
            self.need(all(h >= 1 for h in self.hidden or []), "hidden", "a list of positive layer widths")
            self.need(all(c >= 1 for c in self.channels or []), "channels", "a list of positive channel counts")
            if self.arch is Arch.cnn:
                self.need(bool(self.channels), "channels", "at least one channel count for arch=cnn")
                self.need(self.kernel_size is not None and self.kernel_size >= 1 and self.kernel_size % 2 == 1, "kernel_size",
                          "an odd integer >= 1")
        elif self.source is ModelSource.onnx:
            self.need(bool(self.path), "path", "a path to an .onnx file (relative to the repository) or zoo:<name> when model.source=onnx")
        elif self.source is ModelSource.torch:
            self.need(bool(self.torch_class) and ":" in self.torch_class, "torch_class", "'package.module:Class' when model.source=torch")


CONFIG = {"model": ModelConfig}


def run(cfg, paths: Paths, tracker: NullRun = NO_TRACKING) -> dict:
    model = odt_ops.load_model(source_model(cfg, paths))
    check_fits_data(model, cfg, paths)
    out = paths.out("convert")
    odt_ops.save_model(model, paths.base_model)
    summary = describe(model)
    summary["source"] = describe_source(cfg)
    write_json(out / "model.json", summary)
    write_digests(out)  # pretrain checks base.onnx against it
    return {"n_params": summary["n_params"], "n_nodes": summary["n_nodes"], "opset": summary["opset"]}


def source_model(cfg, paths: Paths) -> onnx.ModelProto | Path:
    """The model before normalization: a ModelProto (built-in, torch) or an ONNX file path."""
    m, d = cfg.model, cfg.data
    if m.source is ModelSource.builtin:
        try:
            if m.arch is Arch.mlp:
                return models.mlp(list(d.input_shape), d.num_classes, list(m.hidden or []), cfg.seed)
            return models.cnn(list(d.input_shape), d.num_classes, list(m.channels), m.kernel_size, list(m.hidden or []), cfg.seed)
        except ValueError as exc:
            raise ModelSourceError(f"model.arch={m.arch.value}: {exc}") from None
    if m.source is ModelSource.onnx:
        return onnx_path(m.path, paths)
    return torch_model(cfg)


def onnx_path(spec: str, paths: Paths) -> Path:
    if spec.startswith("zoo:"):
        name = spec.removeprefix("zoo:")
        path = ZOO_DIR / f"light_{name}.onnx"
        if not path.is_file():
            names = sorted(p.stem.removeprefix("light_") for p in ZOO_DIR.glob("light_*.onnx"))
            raise ModelSourceError(f"model.path={spec}: the onnx wheel ships no zoo model {name!r}; zoo models: {', '.join(names)}")
        return path
    path = paths.resolve(spec)
    if not path.is_file():
        raise ModelSourceError(
            f"model.path={spec}: {path} does not exist; put the ONNX file there (data/models/ is the place) "
            "or choose a built-in model (model=mlp or model=cnn)"
        )
    return path


def torch_model(cfg) -> onnx.ModelProto:
    """Build the module, export it with torch.onnx (TorchScript exporter, opset 17, dynamic batch)."""
    m = cfg.model
    try:
        import torch
    except ImportError:
        raise ModelSourceError(
            f"model.source=torch ({m.torch_class}) needs PyTorch, which is not installed: pip install torch "
            "(the CPU build is enough), or export the model to ONNX yourself and use model=onnx_file"
        ) from None
    module_name, _, class_name = m.torch_class.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ModelSourceError(f"model.torch_class={m.torch_class}: cannot import {module_name!r} ({exc}); check the module path") from None
    cls = getattr(module, class_name, None)
    if cls is None:
        raise ModelSourceError(f"model.torch_class={m.torch_class}: module {module_name!r} has no {class_name!r}")
    torch.manual_seed(cfg.seed)
    kwargs = dict(m.torch_kwargs or {})
    try:
        net = cls(**kwargs)
    except TypeError as exc:
        raise ModelSourceError(f"model.torch_kwargs={kwargs}: {class_name}(**torch_kwargs) failed: {exc}") from None
    net.eval()
    dummy = torch.zeros(2, *cfg.data.input_shape)
    options = {"dynamo": False} if "dynamo" in inspect.signature(torch.onnx.export).parameters else {}
    buf = io.BytesIO()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # the TorchScript exporter: no onnxscript needed
            torch.onnx.export(
                net, (dummy,), buf, input_names=[models.INPUT], output_names=[models.OUTPUT],
                dynamic_axes={models.INPUT: {0: "batch"}, models.OUTPUT: {0: "batch"}}, opset_version=17, **options,
            )
    except Exception as exc:
        raise ModelSourceError(f"model.torch_class={m.torch_class}: torch.onnx.export failed: {str(exc).splitlines()[0]}") from None
    return onnx.load_from_string(buf.getvalue())


def check_fits_data(model: odt_ops.Model, cfg, paths: Paths) -> None:
    """Run the model on samples of the user's training data; errors name the file and input."""
    sess = odt_ops.InferenceSession(model, normalize=False)
    if len(sess.inputs) != 1:
        raise ModelSourceError(
            f"{_name(cfg)}: the model has {len(sess.inputs)} inputs ({', '.join(sess.input_names())}); "
            "the pipeline feeds one (the sample batch)"
        )
    spec = sess.inputs[0]
    data_file = paths.split("user_train")
    x = load_npz(data_file, ("x", "y"), what="prepare output")["x"][:SAMPLE]
    want = spec.shape
    fits = want is not None and len(want) == x.ndim and all(not isinstance(w, int) or w == g for w, g in zip(want[1:], x.shape[1:]))
    if not fits or (spec.dtype is not None and spec.dtype != np.float32):
        shown = "[" + ", ".join("batch" if i == 0 else str(d) for i, d in enumerate(want or [])) + "]"
        raise DataError(
            f"{paths.show(data_file)}: samples of shape {list(x.shape[1:])} (float32) do not fit the model input "
            f"{spec.name!r} {shown} ({spec.dtype}) of {_name(cfg)}; choose a model for data.input_shape="
            f"{list(cfg.data.input_shape)} or data that fits the model"
        )
    try:
        (logits, *_) = sess.run(None, {spec.name: x})
    except odt_ops.OdtError as exc:
        raise DataError(f"{paths.show(data_file)}: {_name(cfg)} fails on its samples: {exc}") from None
    if logits.shape != (len(x), cfg.data.num_classes):
        raise ModelSourceError(
            f"{_name(cfg)}: the first output {sess.output_names()[0]!r} has shape {list(logits.shape)} for {len(x)} samples; "
            f"expected [{len(x)}, {cfg.data.num_classes}] class scores (data.num_classes)"
        )
    if not np.all(np.isfinite(logits)):
        raise ModelSourceError(f"{_name(cfg)}: the model's outputs on {paths.show(data_file)} are not finite")


def describe(model: odt_ops.Model) -> dict:
    from odt_ops.runtime.session import ValueSpec

    arrays = model.initializer_arrays()
    params = {k: list(a.shape) for k, a in arrays.items() if a.dtype.kind == "f"}

    def spec(v):
        s = ValueSpec.of(v)
        return {"name": s.name, "shape": list(s.shape or []), "dtype": str(s.dtype)}

    return {
        "inputs": [spec(v) for v in model.graph.input if v.name not in arrays],
        "outputs": [spec(v) for v in model.graph.output],
        "parameters": params,
        "n_params": int(sum(int(np.prod(s)) for s in params.values())),
        "n_nodes": len(model.graph.node),
        "ops": sorted({n.op_type for n in model.graph.node}),
        "opset": model.opset,
        "ir_version": model.proto.ir_version,
    }


def describe_source(cfg) -> str:
    m = cfg.model
    if m.source is ModelSource.builtin:
        return f"builtin:{m.arch.value}"
    if m.source is ModelSource.onnx:
        return f"onnx:{m.path}"
    return f"torch:{m.torch_class}"


def _name(cfg) -> str:
    return f"model {describe_source(cfg)}"


def main(argv=None) -> int:
    from pipeline.stage import main as stage_main

    return stage_main("convert", run, argv)


if __name__ == "__main__":  # run the imported pipeline.<module>, whose classes the configuration holds (pipeline/stage.py)
    sys.exit(importlib.import_module(__spec__.name).main())
