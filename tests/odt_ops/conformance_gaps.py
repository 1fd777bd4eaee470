"""The one list of ONNX node test cases of claimed ops that the engine does not pass, with why.

Keep it short: every entry is a real, documented limitation.
"""

_DROPOUT_RNG = (
    "random mask: the expected output comes from numpy's legacy global RandomState seeded by the "
    "node's seed attribute; the engine draws every mask from the session's seeded np.random.Generator "
    "so one seed governs a whole training run"
)

_HALF_ATTENTION = (
    "half precision: the expanded Attention function (now runnable: its causal mask uses Mod) chains ~20 "
    "fp16/bf16 ops; a few elements differ from the expected values by one ulp, just over the case's rtol=1e-3, "
    "and the engine's values are the closer ones to the same graph run in float64 (fp16: 3.6e-4 vs 4.9e-4; "
    "bf16: at most 2.5e-3 vs at least 3.6e-3)"
)

_SEQUENCES = (
    "sequence and optional values: the engine's values are tensors only; these cases build or return "
    "sequences (SequenceConstruct, SequenceInsert) or optionals (Optional, OptionalHasElement), ops it has no kernel for"
)

_QUANTIZE_EXOTIC = (
    "QuantizeLinear to float8, float4 or 2-bit integers: odt_ops quantizes to the integer types QDQ models use "
    "(int8, uint8, int16, uint16, int4, uint4) and says so by name for any other"
)

KNOWN_GAPS: dict[str, str] = {
    **{f"test_quantizelinear_{t}": _QUANTIZE_EXOTIC for t in ("e4m3fn", "e5m2", "float4e2m1", "int2", "uint2")},
    **{f"test_attention_{case}_expanded": _HALF_ATTENTION for case in (
        "4d_causal_bf16", "4d_causal_fp16", "4d_padded_kv_bf16", "4d_causal_padded_kv_bf16", "4d_attn_mask_causal_bf16",
        "3d_causal_bf16")},
    "test_training_dropout": _DROPOUT_RNG,
    "test_training_dropout_default": _DROPOUT_RNG,
    "test_training_dropout_mask": _DROPOUT_RNG,
    "test_training_dropout_default_mask": _DROPOUT_RNG,
    **{f"test_{case}": _SEQUENCES for case in ("if_seq", "if_opt", "loop13_seq", "loop16_seq_none")},
}
