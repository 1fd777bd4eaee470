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


def test_readme_training_example_runs(tmp_path, monkeypatch, capsys):
    text = (ROOT / "README.md").read_text()
    example = text.split("## On-device training in twenty lines", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    monkeypatch.chdir(tmp_path)
    exec(compile(example, "README example", "exec"), {})
    out = capsys.readouterr().out
    losses = [float(line.rsplit(" ", 1)[1]) for line in out.splitlines() if line.startswith("epoch")]
    assert len(losses) == 5
    assert losses[-1] < losses[0] * 0.7
    accuracy = float(out.split("accuracy:")[1].split()[0])
    assert accuracy > 0.8
    assert (tmp_path / "artifacts" / "update.odtdiff").is_file()
