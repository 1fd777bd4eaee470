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
            data = json.loads(prop.value)
            if data.get("version", 0) > META_VERSION:
                raise ArtifactError(f"{what}: artifact metadata version {data['version']} is newer than this odt_ops reads; upgrade odt")
            return data
    raise ArtifactError(f"{what}: no {key!r} metadata; generate the artifacts with odt_ops.artifacts.generate_artifacts")


def write(proto: onnx.ModelProto, info: ArtifactInfo) -> None:
    _set(proto, ARTIFACT_KEY, {"version": META_VERSION, **asdict(info)})


def read(proto: onnx.ModelProto, what: str = "model") -> ArtifactInfo:
    data = _get(proto, ARTIFACT_KEY, what)
    data.pop("version", None)
    return ArtifactInfo(**data)


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
    return _get(proto, OPTIMIZER_KEY, what)
