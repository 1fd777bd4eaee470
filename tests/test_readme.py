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
    ci_lines = [l for l in (ROOT / ".ci" / "run").read_text().splitlines() if l and not l.startswith(("#", "set ", "cd "))]
    assert ci_lines == [quickstart()[1]]
