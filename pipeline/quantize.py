"""The pretrained model as int8 QDQ, quantized the usual way (for trainable=qat).

onnxruntime.quantization.quantize_static with QuantFormat.QDQ, per-channel int8 weights and
int8 activations, calibrated (MinMax) on the first CALIBRATION images of the global training
split; what a user quantizing their model for a phone would do.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from pipeline.errors import PipelineError

CALIBRATION = 256


def quantize_qdq(model_path: Path, out_path: Path, calibration: np.ndarray, input_name: str) -> Path:
    try:
        from onnxruntime import quantization
    except ImportError:
        raise PipelineError("trainable=qat quantizes the model with onnxruntime.quantization: pip install -e '.[pipeline]'") from None

    out_path.parent.mkdir(parents=True, exist_ok=True)

    class Reader(quantization.CalibrationDataReader):
        def __init__(self):
            self.batches = iter([{input_name: calibration[i:i + 32]} for i in range(0, min(len(calibration), CALIBRATION), 32)])

        def get_next(self):
            return next(self.batches, None)

    quantization.quantize_static(str(model_path), str(out_path), Reader(), quant_format=quantization.QuantFormat.QDQ, per_channel=True,
                                 activation_type=quantization.QuantType.QInt8, weight_type=quantization.QuantType.QInt8)
    return out_path
