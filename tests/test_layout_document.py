"""docs/architecture.md stays true: it names every package folder of odt_ops/ and pipeline/
and nothing that is gone, and no import (a function-level one included) runs from a room up
to a higher floor than the page gives it."""
from __future__ import annotations

import re
from pathlib import Path

from tests.test_import_cycles import PACKAGES, ROOT, _edges, _modules

DOCUMENT = ROOT / "docs" / "architecture.md"
ROW = re.compile(r"^\|\s*(\d+)\s*\|(.*?)\|", re.MULTILINE)
ROOM = re.compile(r"`((?:" + "|".join(PACKAGES) + r")/[^`]*)`")


def _floors(text: str) -> dict[str, int]:
    """Each room the page's tables name (a folder ends in /), with its floor."""
    floors = {}
    for floor, cell in ROW.findall(text):
        for path in ROOM.findall(cell):
            floors[path] = int(floor)
    return floors


def _package_folders() -> set[str]:
    return {f"{p.parent.relative_to(ROOT).as_posix()}/" for package in PACKAGES for p in (ROOT / package).rglob("__init__.py")}


def _room(path: Path, rooms: dict[str, int], root: Path) -> str:
    """The most specific room holding the module: itself if named, else its nearest named folder."""
    rel = path.relative_to(root).as_posix()
    if rel in rooms:
        return rel
    folder = path.parent
    while f"{folder.relative_to(root).as_posix()}/" not in rooms:
        folder = folder.parent
    return f"{folder.relative_to(root).as_posix()}/"


def _upward_imports(modules: dict[str, Path], rooms: dict[str, int], root: Path = ROOT) -> list[str]:
    found = []
    for name, path in sorted(modules.items()):
        room = _room(path, rooms, root)
        for target in sorted(_edges(name, path, modules)):
            other = _room(modules[target], rooms, root)
            if rooms[other] > rooms[room]:
                found.append(f"{name} (floor {rooms[room]}, {room}) imports {target} (floor {rooms[other]}, {other})")
    return found


def test_the_document_names_every_package_folder():
    named = {p for p in _floors(DOCUMENT.read_text(encoding="utf-8")) if p.endswith("/")}
    unnamed = sorted(_package_folders() - named)
    assert not unnamed, f"package folders docs/architecture.md does not name: {unnamed}; add a row with its floor"


def test_everything_the_document_names_exists():
    gone = sorted(p for p in _floors(DOCUMENT.read_text(encoding="utf-8"))
                  if not (p.endswith("/") and (ROOT / p / "__init__.py").is_file() or (ROOT / p).is_file()))
    assert not gone, f"docs/architecture.md names {gone}, which are not in the tree (or not a package)"


def test_no_import_runs_up_a_floor():
    assert _upward_imports(_modules(), _floors(DOCUMENT.read_text(encoding="utf-8"))) == []


def test_an_upward_import_is_found(tmp_path):
    # the check itself: a ground-floor module that imports (inside a function) a room above
    (tmp_path / "odt_ops" / "api").mkdir(parents=True)
    (tmp_path / "odt_ops" / "__init__.py").write_text("")
    (tmp_path / "odt_ops" / "errors.py").write_text("def f():\n    from odt_ops.api import module\n")
    (tmp_path / "odt_ops" / "api" / "__init__.py").write_text("")
    (tmp_path / "odt_ops" / "api" / "module.py").write_text("from odt_ops.errors import f\n")
    modules = {"odt_ops": tmp_path / "odt_ops" / "__init__.py", "odt_ops.errors": tmp_path / "odt_ops" / "errors.py",
               "odt_ops.api": tmp_path / "odt_ops" / "api" / "__init__.py",
               "odt_ops.api.module": tmp_path / "odt_ops" / "api" / "module.py"}
    rooms = _floors("| 0 | `odt_ops/errors.py` | |\n| 4 | `odt_ops/` | |\n| 6 | `odt_ops/api/` | |\n")
    assert rooms == {"odt_ops/errors.py": 0, "odt_ops/": 4, "odt_ops/api/": 6}
    assert _upward_imports(modules, rooms, tmp_path) == [
        "odt_ops.errors (floor 0, odt_ops/errors.py) imports odt_ops.api.module (floor 6, odt_ops/api/)"]
