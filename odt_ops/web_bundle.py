"""The web bundle: training artifacts as a browser tab reads them (web/'s ``odt-web`` module).

A browser has no zip or protobuf reader at hand, so the bundle is two files: ``bundle.json``
(the manifest) and ``bundle.bin`` (the three models' bytes and every tensor's raw
little-endian bytes, each at an 8-byte aligned offset, so a typed array views it in place).
The manifest carries the sha256 of each model and of the binary, the models' roles copied
from their ``odt.artifact`` / ``odt.optimizer`` metadata (the browser cannot read ONNX
metadata without a protobuf library), the checkpoint's parameters, buffers and optimizer
state, and the base hash a model difference made from these parameters must carry (so
``odt_ops.export.apply_diff`` takes the browser's update). Optionally it holds sample sets
(the demo's slanted digits and holdout). Nothing is pickled.

``write_web_bundle(..., page=True)`` also copies the demo page, the module and
onnxruntime-web's WebAssembly runtime (from web/node_modules, after ``npm ci`` in web/)
beside the bundle, so ``python -m http.server`` serves a working page from that folder.
"""
from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import asdict
from pathlib import Path

import numpy as np
import onnx

from odt_ops import meta
from odt_ops.checkpoint import Checkpoint, load_checkpoint
from odt_ops.errors import WebBundleError
from odt_ops.export import model_diff
from odt_ops.io import atomic_writer
from odt_ops.ir.load import read_model

FORMAT = "odt-web-bundle"
FORMAT_VERSION = 1
MANIFEST = "bundle.json"
BINARY = "bundle.bin"
ALIGN = 8  # the widest element (int64, float64): every typed array over the binary starts aligned
# the optimizer graph's scalar inputs (odt_ops.artifacts builds them under these names)
OPTIMIZER_SCALARS = {"learning_rate": "learning_rate", "step": "step"}
DEFAULT_LEARNING_RATE = 1e-3  # what odt_ops.api.Optimizer starts from when the checkpoint has none
MODELS = {"training": "training_model.onnx", "eval": "eval_model.onnx", "optimizer": "optimizer_model.onnx"}
# element types onnxruntime-web's tensors take, by numpy dtype (the names agree)
DTYPES = ("float32", "float64", "int32", "int64")

# the page's files: (source under the repository's web/, name in the bundle's folder)
PAGE_FILES = (("demo/index.html", "index.html"), ("demo/demo.js", "demo.js"), ("src/odt-web.js", "odt-web.js"))
ORT_DIST = "node_modules/onnxruntime-web/dist"
ORT_FILES = ("ort.wasm.min.mjs", "ort-wasm-simd-threaded.mjs", "ort-wasm-simd-threaded.wasm")


class _Binary:
    """The growing binary and the manifest entries that point into it."""

    def __init__(self) -> None:
        self.parts: list[bytes] = []
        self.size = 0

    def add(self, data: bytes) -> dict:
        pad = -self.size % ALIGN
        if pad:
            self.parts.append(b"\0" * pad)
            self.size += pad
        entry = {"offset": self.size, "bytes": len(data)}
        self.parts.append(data)
        self.size += len(data)
        return entry

    def tensor(self, name: str, array: np.ndarray, **extra) -> dict:
        array = np.asarray(array)
        if array.dtype.name not in DTYPES:
            raise WebBundleError(f"{name}: dtype {array.dtype} has no onnxruntime-web tensor type here; the bundle takes {DTYPES}")
        data = np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<")).tobytes()
        return {"name": name, **extra, "dtype": array.dtype.name, "shape": list(array.shape), **self.add(data)}


def _input_specs(graph: onnx.GraphProto, names: list[str]) -> dict[str, dict]:
    """dtype and shape (None for a symbolic dimension) of the graph inputs the caller feeds."""
    specs = {}
    for value in graph.input:
        if value.name in names:
            t = value.type.tensor_type
            dtype = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(t.elem_type)).name
            specs[value.name] = {"dtype": dtype, "shape": [d.dim_value if d.HasField("dim_value") else None for d in t.shape.dim]}
    return specs


def _roles(proto: onnx.ModelProto, path: Path) -> meta.ArtifactInfo:
    info = meta.read(proto, str(path))
    if info.unfed_inputs:
        raise WebBundleError(f"{path}: inputs {info.unfed_inputs} are fed by onnxruntime's own gradient accumulation, which the "
                             "browser does not run; generate the artifacts with odt_ops.artifacts.generate_artifacts")
    return info


def _optimizer_roles(proto: onnx.ModelProto, path: Path, trainable: list[str]) -> dict:
    data = meta.read_optimizer(proto, str(path))
    inputs = {i.name for i in proto.graph.input}
    absent = [n for n in OPTIMIZER_SCALARS.values() if n not in inputs]
    if absent:
        raise WebBundleError(f"{path}: the optimizer model has no input {absent}; generate it with odt_ops.artifacts.generate_artifacts")
    listed = [p["name"] for p in data["parameters"]]
    if listed != trainable:
        raise WebBundleError(f"{path}: the optimizer updates {listed}, the training model trains {trainable}; the artifacts do not belong together")
    return {"kind": data["kind"], "hyperparameters": data.get("hyperparameters", {}), "scalar_inputs": OPTIMIZER_SCALARS,
            "parameters": data["parameters"]}


def _load_samples(name: str, path: Path) -> tuple[np.ndarray, np.ndarray]:
    """``x`` and ``y`` of an .npz (allow_pickle=False: an object array is refused, never unpickled)."""
    try:
        with np.load(path, allow_pickle=False) as data:
            x, y = np.asarray(data["x"]), np.asarray(data["y"])
    except (OSError, KeyError, ValueError) as exc:
        raise WebBundleError(f"{path}: the {name!r} samples must be an .npz with arrays x and y ({exc})") from None
    if len(x) != len(y) or y.ndim != 1 or not np.issubdtype(y.dtype, np.integer):
        raise WebBundleError(f"{path}: the {name!r} samples need x [N, ...] and integer class ids y [N]; got x {list(x.shape)}, y {y.dtype}{list(y.shape)}")
    return x, y


def _check_fits(path: Path, set_name: str, x: np.ndarray, user_inputs: list[str], inputs: dict[str, dict]) -> None:
    """Samples are for a model of one data input, each of the shape it takes (odt-web feeds x alone)."""
    if len(user_inputs) != 1:
        raise WebBundleError(f"{path}: samples are bundled for a model of one data input; this one takes {user_inputs}")
    if inputs[user_inputs[0]]["dtype"] != "float32":
        raise WebBundleError(f"{path}: samples are bundled as float32; the model's input {user_inputs[0]!r} takes {inputs[user_inputs[0]]['dtype']}")
    wanted = inputs[user_inputs[0]]["shape"][1:]
    if len(wanted) != x.ndim - 1 or any(d is not None and d != n for d, n in zip(wanted, x.shape[1:])):
        raise WebBundleError(f"{path}: the {set_name!r} samples are {list(x.shape[1:])} each, the model's input "
                             f"{user_inputs[0]!r} takes {wanted} (None: any size)")


def write_web_bundle(artifact_dir: str | Path, out_dir: str | Path, *, samples: Mapping[str, str | Path] | None = None,
                     page: bool = False, web_dir: str | Path | None = None) -> dict:
    """Write ``bundle.json`` and ``bundle.bin`` for the artifacts in ``artifact_dir`` into
    ``out_dir``; ``samples`` maps a set's name (``train``, ``holdout``) to an .npz with x and y.
    With ``page``, also the demo page and onnxruntime-web's runtime. Returns the manifest."""
    src, out = Path(artifact_dir), Path(out_dir)
    paths = {role: src / name for role, name in MODELS.items()}
    missing = [str(p) for p in (*paths.values(), src / "checkpoint") if not p.is_file()]
    if missing:
        raise WebBundleError(f"{src}: not a training artifact folder: {missing} not found (odt_ops.artifacts.generate_artifacts writes them)")
    raw = {role: path.read_bytes() for role, path in paths.items()}
    protos = {role: read_model(path).proto for role, path in paths.items()}
    train_info = _roles(protos["training"], paths["training"])
    eval_info = _roles(protos["eval"], paths["eval"])
    ckpt: Checkpoint = load_checkpoint(src / "checkpoint")
    if ckpt.nominal:
        raise WebBundleError(f"{src / 'checkpoint'}: a nominal checkpoint holds no values; bundle a checkpoint with the parameters")
    absent = [n for n in train_info.parameters if n not in ckpt.parameters] + [n for n in train_info.buffers if n not in ckpt.buffers]
    if absent:
        raise WebBundleError(f"{src / 'checkpoint'}: has no values for {absent}, which the training model takes")

    binary = _Binary()
    models = {role: {"file": MODELS[role], **binary.add(data), "sha256": hashlib.sha256(data).hexdigest()} for role, data in raw.items()}
    tensors = [binary.tensor(n, ckpt.parameters[n], kind="parameter", trainable=n in train_info.trainable) for n in train_info.parameters]
    tensors += [binary.tensor(n, ckpt.buffers[n], kind="buffer") for n in train_info.buffers]
    opt = ckpt.optimizer
    for pname, states in (opt.states if opt else {}).items():
        tensors += [binary.tensor(pname, value, kind="state", state=sname) for sname, value in states.items()]
    sample_sets = {}
    inputs = _input_specs(protos["training"].graph, [*train_info.user_inputs, *train_info.labels])
    for set_name, path in (samples or {}).items():
        x, y = _load_samples(set_name, Path(path))
        _check_fits(Path(path), set_name, x, train_info.user_inputs, inputs)
        sample_sets[set_name] = {"x": binary.tensor("x", x.astype(np.float32)), "y": binary.tensor("y", y.astype(np.int64))}

    blob = b"".join(binary.parts)
    # the parameters as the training model trains them: odt-web's difference lists exactly these trainable ones
    as_trained = Checkpoint(parameters={n: ckpt.parameters[n] for n in train_info.parameters},
                            requires_grad={n: n in train_info.trainable for n in train_info.parameters})
    manifest = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "binary": {"file": BINARY, "bytes": len(blob), "sha256": hashlib.sha256(blob).hexdigest()},
        "models": models,
        "training": {**asdict(train_info), "inputs": inputs},
        "eval": {"user_inputs": eval_info.user_inputs, "labels": eval_info.labels, "loss": eval_info.loss,
                 "extra_outputs": eval_info.extra_outputs, "parameters": eval_info.parameters, "buffers": eval_info.buffers},
        "optimizer": {**_optimizer_roles(protos["optimizer"], paths["optimizer"], train_info.trainable),
                      "learning_rate": float(opt.learning_rate) if opt and opt.learning_rate else DEFAULT_LEARNING_RATE,
                      "step": int(opt.step) if opt else 0},
        # what odt_ops.export.apply_diff checks a difference's base against
        "base_hash": model_diff(as_trained, as_trained).base_hash,
        "tensors": tensors,
        "samples": sample_sets,
    }
    out.mkdir(parents=True, exist_ok=True)
    with atomic_writer(out / BINARY) as f:
        f.write(blob)
    with atomic_writer(out / MANIFEST) as f:  # last: a manifest on disk always describes the binary beside it
        f.write(json.dumps(manifest, indent=1).encode())
    if page:
        copy_page(out, web_dir)
    return manifest


def default_web_dir() -> Path:
    """The repository's web/ folder (beside odt_ops/ in a source checkout or editable install)."""
    return Path(__file__).resolve().parents[1] / "web"


def copy_page(out_dir: str | Path, web_dir: str | Path | None = None) -> None:
    """The demo page, odt-web.js and onnxruntime-web's WebAssembly runtime, into ``out_dir``."""
    web, out = Path(web_dir) if web_dir else default_web_dir(), Path(out_dir)
    sources = [(web / s, out / d) for s, d in PAGE_FILES] + [(web / ORT_DIST / f, out / "ort" / f) for f in ORT_FILES]
    missing = [str(s) for s, _ in sources if not s.is_file()]
    if missing:
        raise WebBundleError(f"the page's files are missing: {missing[:3]}{' ...' if len(missing) > 3 else ''}; run `npm ci` in "
                             f"{web} (it installs onnxruntime-web), or pass --no-page to write the bundle alone")
    for s, d in sources:
        with atomic_writer(d) as f:  # a server never hands out half a runtime
            f.write(s.read_bytes())


__all__ = ["BINARY", "FORMAT", "MANIFEST", "copy_page", "write_web_bundle"]
