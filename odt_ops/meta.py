"""What the runtime needs to know about artifacts, recorded in the models' metadata.

Roles are never guessed from value names: the training and eval models carry one
JSON entry (``odt.artifact``) saying which inputs are user data, labels, trainable and
frozen parameters and buffers, which output is the loss, which output is which
parameter's gradient or buffer's update, and the original inference outputs. The
optimizer model carries ``odt.optimizer``: its kind, hyperparameters and per-parameter
input and output names.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

import onnx

from odt_ops.errors import ArtifactError

ARTIFACT_KEY = "odt.artifact"
OPTIMIZER_KEY = "odt.optimizer"
META_VERSION = 1


@dataclass
class ArtifactInfo:
    user_inputs: list[str]
    labels: list[str]
    trainable: list[str]
    frozen: list[str]
    buffers: list[str]
    loss: str
    extra_outputs: list[str] = field(default_factory=list)
    gradients: dict[str, str] = field(default_factory=dict)  # parameter -> gradient output
    buffer_updates: dict[str, str] = field(default_factory=dict)  # buffer -> updated output
    inference_outputs: list[str] = field(default_factory=list)
    # inputs the Module does not feed; it leaves out the nodes that read them (a TrainingBlock's
    # ONNX Runtime-style gradient accumulation, which the Module does in its own buffers)
    unfed_inputs: list[str] = field(default_factory=list)
    input_gradients: dict[str, str] = field(default_factory=dict)  # graph input -> its gradient output (TrainingBlock)

    @property
    def parameters(self) -> list[str]:
        return [*self.trainable, *self.frozen]


def _set(proto: onnx.ModelProto, key: str, value: Any) -> None:
    for prop in proto.metadata_props:
        if prop.key == key:
            prop.value = json.dumps(value)
            return
    proto.metadata_props.append(onnx.StringStringEntryProto(key=key, value=json.dumps(value)))


def _get(proto: onnx.ModelProto, key: str, what: str) -> dict:
    for prop in proto.metadata_props:
        if prop.key == key:
            try:
                data = json.loads(prop.value)
            except (ValueError, RecursionError) as exc:  # RecursionError: nested deeper than json parses
                raise ArtifactError(f"{what}: the {key!r} metadata is not JSON ({type(exc).__name__}: {str(exc)[:200]}); "
                                    "the file is damaged") from None
            if not isinstance(data, dict):
                raise ArtifactError(f"{what}: the {key!r} metadata is a {type(data).__name__}, not a mapping; the file is damaged")
            version = data.get("version", 0)
            if not isinstance(version, int) or version > META_VERSION:
                raise ArtifactError(f"{what}: artifact metadata version {version!r} is newer than this odt_ops reads; upgrade odt")
            return data
    raise ArtifactError(f"{what}: no {key!r} metadata; generate the artifacts with odt_ops.artifacts.generate_artifacts")


def _is_names(value: object) -> bool:
    return isinstance(value, list) and all(isinstance(v, str) for v in value)


def _is_name_map(value: object) -> bool:
    return isinstance(value, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in value.items())


# what each ArtifactInfo field must hold, checked before the dataclass is built
_ARTIFACT_FIELDS = {"user_inputs": _is_names, "labels": _is_names, "trainable": _is_names, "frozen": _is_names,
                    "buffers": _is_names, "loss": lambda v: isinstance(v, str), "extra_outputs": _is_names,
                    "gradients": _is_name_map, "buffer_updates": _is_name_map, "inference_outputs": _is_names,
                    "unfed_inputs": _is_names, "input_gradients": _is_name_map}
_REQUIRED = ("user_inputs", "labels", "trainable", "frozen", "buffers", "loss")


def write(proto: onnx.ModelProto, info: ArtifactInfo) -> None:
    _set(proto, ARTIFACT_KEY, {"version": META_VERSION, **asdict(info)})


def read(proto: onnx.ModelProto, what: str = "model") -> ArtifactInfo:
    data = _get(proto, ARTIFACT_KEY, what)
    data.pop("version", None)
    problems = [f"{k} is missing" for k in _REQUIRED if k not in data]
    problems += [f"unknown field {k!r}" for k in data if k not in _ARTIFACT_FIELDS]
    problems += [f"{k} has the wrong kind" for k, v in data.items() if k in _ARTIFACT_FIELDS and not _ARTIFACT_FIELDS[k](v)]
    if problems:
        raise ArtifactError(f"{what}: the {ARTIFACT_KEY!r} metadata is damaged: {'; '.join(problems)}")
    return ArtifactInfo(**data)


def _is_hyperparameter(value: object) -> bool:
    """A scalar setting (learning rate, mode, flag, unset clip norm) or a short tuple of numbers
    (AdamW's betas); anything deeper is damage that would only surface at the first step."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return True
    return isinstance(value, list) and len(value) <= 4 and all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                                               for v in value)


def write_optimizer(proto: onnx.ModelProto, opt, slots, outputs: list[str]) -> None:
    per_param = []
    i = 0
    for p in slots:
        n = 1 + len(p.states)
        per_param.append({"name": p.name, "value": p.value, "grad": p.grad, "states": dict(zip(opt.state_names, p.states)),
                          "outputs": outputs[i : i + n]})
        i += n
    _set(proto, OPTIMIZER_KEY, {"version": META_VERSION, "kind": opt.kind, "hyperparameters": opt.hyperparameters(), "parameters": per_param})


def read_optimizer(proto: onnx.ModelProto, what: str = "optimizer model") -> dict:
    data = _get(proto, OPTIMIZER_KEY, what)
    params = data.get("parameters")

    def slot_ok(p: object) -> bool:
        return (isinstance(p, dict) and all(isinstance(p.get(k), str) for k in ("name", "value", "grad"))
                and _is_name_map(p.get("states")) and _is_names(p.get("outputs")))

    hyper = data.get("hyperparameters", {})
    if not (isinstance(data.get("kind"), str) and isinstance(hyper, dict) and all(map(_is_hyperparameter, hyper.values()))
            and isinstance(params, list) and all(slot_ok(p) for p in params)):
        raise ArtifactError(f"{what}: the {OPTIMIZER_KEY!r} metadata is damaged (kind, hyperparameters and per-parameter "
                            "names of the wrong kind or missing)")
    return data
