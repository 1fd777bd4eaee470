"""The one list of ONNX node test cases of claimed ops that the engine does not pass, with why.

Keep it short: every entry is a real, documented limitation.
"""

KNOWN_GAPS: dict[str, str] = {}
