"""The README's quickstart stays what CI runs."""
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def quickstart() -> list[str]:
    text = (ROOT / "README.md").read_text()
    block = text.split("```bash\n", 1)[1].split("```", 1)[0]
    return [line for line in block.splitlines() if line.strip()]


def test_quickstart_is_two_commands():
    assert len(quickstart()) == 2


def test_ci_runs_the_readme_test_command():
    """Setup commands (installing Chromium and web/'s npm packages) may come first; the README's
    test command is CI's last command, verbatim."""
    ci_lines = [l for l in (ROOT / ".ci" / "run").read_text().splitlines() if l and not l.startswith(("#", "set ", "cd "))]
    assert ci_lines
    assert ci_lines[-1] == quickstart()[1]
    assert quickstart()[1] not in ci_lines[:-1]


def python_block(after: str) -> str:
    """The README's first Python block after the line ``after``."""
    return (ROOT / "README.md").read_text().split(after, 1)[1].split("```python\n", 1)[1].split("```", 1)[0]


TWENTY_LINES = "## On-device training in twenty lines"


def test_readme_training_example_runs(tmp_path, monkeypatch, capsys):
    example = python_block(TWENTY_LINES)
    monkeypatch.chdir(tmp_path)
    exec(compile(example, "README example", "exec"), {})
    out = capsys.readouterr().out
    losses = [float(line.rsplit(" ", 1)[1]) for line in out.splitlines() if line.startswith("epoch")]
    assert len(losses) == 5
    assert losses[-1] < losses[0] * 0.7
    accuracy = float(out.split("accuracy:")[1].split()[0])
    assert accuracy > 0.8
    assert (tmp_path / "artifacts" / "update.odtdiff").is_file()


def test_readme_lora_example_runs_after_the_twenty_lines(tmp_path, monkeypatch, capsys):
    """The LoRA block as written, after the twenty lines whose model, x and y it takes: onnxruntime
    running the base model with the user's adapter gives the merged model's logits (onnxruntime
    itself is the oracle for both), and training moved the adapter off its zero start."""
    import numpy as np
    import onnxruntime

    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    exec(compile(python_block(TWENTY_LINES), "README example", "exec"), namespace)
    exec(compile(python_block("**LoRA.**"), "README LoRA example", "exec"), namespace)
    x, logits = namespace["x"], namespace["logits"]
    merged = onnxruntime.InferenceSession("merged.onnx").run(None, {"x": x})[0]
    np.testing.assert_allclose(logits, merged, rtol=1e-5, atol=1e-6)
    plain = onnxruntime.InferenceSession("base.onnx").run(None, {"x": x})[0]  # no adapter: B is zero
    assert not np.allclose(plain, merged, atol=1e-4)
