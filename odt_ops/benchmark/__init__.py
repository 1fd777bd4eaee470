"""The training benchmark: odt against ONNX Runtime training, PyTorch eager and our own
artifacts on onnxruntime's inference build, side by side, one fresh process per run.

``python -m odt_ops.benchmark --help``; the README's "Benchmark" section says what is
measured and how the comparators are set up.
"""
