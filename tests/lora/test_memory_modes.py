"""`python -m odt_ops.benchmark.profile --memory B --modes full lora`: the report's LoRA row
trains and sends up fewer parameters than full fine-tuning, and both rows are measured."""
from __future__ import annotations

import re

from odt_ops.benchmark.profile import mode_memory_report


def test_memory_modes_report_full_and_lora_rows():
    report = mode_memory_report("mlp-adamw", 8, ["full", "lora"])
    rows = {m.group(1): [float(v.rstrip("%")) for v in m.group(2).split()] for m in re.finditer(r"^\s*(full|lora)\s+(.*)$", report, re.M)}
    full, lora = rows["full"], rows["lora"]
    assert full[0] == 101770
    assert full[1] == 100.0  # every parameter of the 784-128-10 MLP trains
    assert lora[0] < full[0] / 10
    assert lora[2] < full[2]  # adapters only: fewer parameters, a lower peak
    assert lora[4] < full[4] / 10  # and a model difference a tenth the size

