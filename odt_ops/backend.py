"""An onnx.backend.base.Backend over the numpy engine, so the ONNX spec's node tests run against us."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import onnx
from onnx.backend.base import Backend, BackendRep

from odt_ops.errors import OdtError
from odt_ops.runtime.session import InferenceSession


class OdtRep(BackendRep):
    def __init__(self, session: InferenceSession):
        self.session = session

    def run(self, inputs: Any, **kwargs: Any) -> tuple[np.ndarray, ...]:
        if isinstance(inputs, dict):
            feeds = inputs
        else:
            if isinstance(inputs, np.ndarray):
                inputs = [inputs]
            feeds = dict(zip(self.session.input_names(), inputs))
        return tuple(np.asarray(v) for v in self.session.run(None, feeds))


class OdtBackend(Backend):
    @classmethod
    def prepare(cls, model: onnx.ModelProto, device: str = "CPU", **kwargs: Any) -> OdtRep:
        # conformance runs each op at the opset the test declares, unconverted
        return OdtRep(InferenceSession(model, normalize=kwargs.get("normalize", False)))

    @classmethod
    def run_model(cls, model: onnx.ModelProto, inputs: Any, device: str = "CPU", **kwargs: Any) -> tuple[np.ndarray, ...]:
        return cls.prepare(model, device, **kwargs).run(inputs)

    @classmethod
    def supports_device(cls, device: str) -> bool:
        return device.upper() == "CPU"

    @classmethod
    def is_compatible(cls, model: onnx.ModelProto, device: str = "CPU", **kwargs: Any) -> bool:
        try:
            cls.prepare(model, device, **kwargs)
        except OdtError:
            return False
        return True


prepare = OdtBackend.prepare
run_model = OdtBackend.run_model
supports_device = OdtBackend.supports_device

__all__: Sequence[str] = ["OdtBackend", "OdtRep", "prepare", "run_model", "supports_device"]
