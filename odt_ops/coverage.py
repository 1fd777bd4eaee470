"""The one list of default-domain ops that do not train here, each with why.

Every op of ONNX's default domain is, for the engine, one of:
- run by a kernel and differentiated by a rule (odt_ops/kernels, odt_ops/grad/rules);
- run by a kernel and not differentiable: NOT_DIFFERENTIABLE says why;
- rewritten at load into ops of the first kind: the ops ONNX defines as functions
  (odt_ops/ir/functions.py) and the recurrent ops (odt_ops/ir/recurrent.py);
- not run at all: NOT_SUPPORTED says why.
tests/odt_ops/test_op_coverage.py holds every op to exactly one of these, and
``python -m odt_ops check`` quotes the reason for an op a model uses.
"""
from __future__ import annotations

_BOOLEAN = "its output is boolean: no gradient flows through a comparison or a logical op"
_INDEX = "its output is integer (indices, counts or shapes): nothing to differentiate"
_NO_FLOAT_INPUT = "it makes a tensor from attributes or shapes only: no float input to differentiate"

NOT_DIFFERENTIABLE: dict[str, str] = {
    **dict.fromkeys(["And", "Or", "Xor", "Not", "Equal", "Greater", "GreaterOrEqual", "Less", "LessOrEqual",
                     "IsInf", "IsNaN"], _BOOLEAN),
    **dict.fromkeys(["ArgMax", "ArgMin", "NonZero", "Shape", "Size", "Range"], _INDEX),
    **dict.fromkeys(["Constant", "ConstantOfShape", "EyeLike"], _NO_FLOAT_INPUT),
    "OneHot": "its indices are integers; a gradient for its on/off values has no use in a model",
    "If": "differentiated by taking the branch at load when the condition is known, else both branches "
          "(odt_ops/ir/control_flow.py), never as a node",
    "Scan": "differentiated by unrolling at load over a static length, else as the Loop it becomes (axis 0, forwards; "
            "odt_ops/ir/control_flow.py)",
    "QuantizeLinear": "its output is integer; generate_artifacts trains a QDQ model through each Quantize/DequantizeLinear "
                      "pair with the straight-through estimator, written in standard ops beside it (odt_ops/quant/qat.py)",
}

_INTEGER = "integer arithmetic: nothing in it trains"
_QUANTIZED = ("quantized integer arithmetic (onnxruntime's QOperator format); quantize to the QDQ format "
              "(QuantizeLinear/DequantizeLinear pairs, quant_format=QuantFormat.QDQ), which fine-tunes")
_SEQUENCE = "tensor sequences and optionals are not values the engine carries (tensors only)"
_STRING = "string processing: no tensor to train"
_RANDOM = "a random draw inside the model; the engine's one seeded generator serves Dropout only"

NOT_SUPPORTED: dict[str, str] = {
    **dict.fromkeys(["BitCast", "BitShift", "BitwiseAnd", "BitwiseNot", "BitwiseOr", "BitwiseXor"], _INTEGER),
    **dict.fromkeys(["QLinearConv", "QLinearMatMul"], _QUANTIZED),
    **dict.fromkeys(["ConvInteger", "MatMulInteger"], "no kernel of its own: in onnxruntime's quantize_dynamic pattern (DynamicQuantizeLinear "
                    "-> it -> Cast -> Mul by the scales) it is rewritten at load into DequantizeLinear + MatMul/Conv "
                    "(odt_ops/ir/integer_ops.py), which fine-tunes; other uses are refused there, naming the node"),
    **dict.fromkeys(["ConcatFromSequence", "SequenceAt", "SequenceConstruct", "SequenceEmpty", "SequenceErase",
                     "SequenceInsert", "SequenceLength", "SplitToSequence", "Optional", "OptionalGetElement",
                     "OptionalHasElement"], _SEQUENCE),
    **dict.fromkeys(["RegexFullMatch", "StringConcat", "StringNormalizer", "StringSplit", "TfIdfVectorizer"], _STRING),
    **dict.fromkeys(["RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike", "Multinomial"], _RANDOM),
    "ImageDecoder": "decodes image files: preprocessing, not a layer",
    "NonMaxSuppression": "detection post-processing with integer outputs: run it after the model",
    "Unique": "data-dependent output shape, integer outputs: not a layer",
    "MelWeightMatrix": "builds a constant filter bank from scalars: precompute it as an initializer",
    "DFT": "complex-valued spectra are not implemented (no kernel); precompute features outside the model",
    "STFT": "complex-valued spectra are not implemented (no kernel); precompute features outside the model",
    "Col2Im": "not implemented yet (no kernel); express it as ConvTranspose with an identity kernel",
    "CumProd": "not implemented yet (no kernel, opset 26)",
    "DeformConv": "not implemented yet (no kernel)",
    "Det": "not implemented yet (no kernel)",
    "GlobalLpPool": "not implemented yet (no kernel); ReduceL2 over the spatial axes is the p=2 case",
    "GridSample": "not implemented yet (no kernel)",
    "MaxRoiPool": "detection-specific pooling: not implemented (no kernel)",
    "RoiAlign": "detection-specific pooling: not implemented (no kernel)",
    "MaxUnpool": "not implemented yet (no kernel)",
    "TensorScatter": "not implemented yet (no kernel, opset 24 KV-cache update)",
}


def reason(op_type: str) -> str | None:
    """Why ``op_type`` does not train here, or None if it does (or is unknown)."""
    return NOT_DIFFERENTIABLE.get(op_type) or NOT_SUPPORTED.get(op_type)
