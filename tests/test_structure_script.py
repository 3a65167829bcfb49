"""scripts/structure.py on a tiny synthetic tree: it finds exactly the one cycle (closed by a
function-local relative import), the one layering violation and the one class over 350
lines planted there, and nothing else."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "structure.py"


@pytest.fixture(scope="module")
def structure():
    spec = importlib.util.spec_from_file_location("structure_script", SCRIPT)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(spec.name, None)


def _write(root: Path, rel: str, text: str) -> None:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    _write(tmp_path, "pstar_core/__init__.py", "")
    # `from pkg import name` where name is a submodule: an edge to pstar_core.checkpoint
    _write(
        tmp_path,
        "pstar_core/engine.py",
        "from pstar_core import checkpoint\n\n\nclass Engine:\n    saver = checkpoint\n",
    )
    # closes the cycle from inside a function, through a relative import
    _write(
        tmp_path,
        "pstar_core/checkpoint.py",
        "def load():\n    from .engine import Engine\n\n    return Engine\n",
    )
    _write(tmp_path, "service/__init__.py", "")
    _write(
        tmp_path,
        "service/control/jobs.py",
        '"""Jobs."""\n\nimport json\n\nimport fastapi\n\nfrom pstar_core.engine import Engine\n',
    )
    _write(tmp_path, "service/models.py", "class Big:\n" + "    x = 1\n" * 399)
    _write(tmp_path, "README.md", "not python\n")
    return tmp_path


def test_finds_exactly_the_planted_structure(structure, tree: Path) -> None:
    data = structure.analyze(tree)

    assert {name: (p["files"], p["lines"]) for name, p in data["packages"].items()} == {
        "pstar_core": (3, 9),
        "service": (3, 407),
    }
    assert data["cycles"] == [
        {
            "modules": ["pstar_core.checkpoint", "pstar_core.engine"],
            "cycle": ["pstar_core.checkpoint", "pstar_core.engine", "pstar_core.checkpoint"],
            "edges": [
                {
                    "from": "pstar_core.checkpoint",
                    "to": "pstar_core.engine",
                    "at": ["pstar_core/checkpoint.py:2 (in function)"],
                },
                {
                    "from": "pstar_core.engine",
                    "to": "pstar_core.checkpoint",
                    "at": ["pstar_core/engine.py:1 (top-level)"],
                },
            ],
        }
    ]
    assert [(v["file"], v["line"], v["imports"]) for v in data["violations"]] == [
        ("service/control/jobs.py", 5, "fastapi")
    ]
    assert [(c["file"], c["name"], c["lines"]) for c in data["classes_over_350"]] == [
        ("service/models.py", "Big", 400)
    ]
    assert data["largest_class"]["name"] == "Big"
    assert data["largest_function"]["name"] == "load"
    assert data["files_over_700"] == []
    assert data["package_edges"] == {
        "service -> pstar_core": {"imports": 1, "top_level": 1, "in_functions": 0, "type_only": 0}
    }
    assert data["third_party"] == {
        "service": {"fastapi": {"imports": 1, "top_level": 1, "in_functions": 0, "type_only": 0}}
    }
    assert data["parse_errors"] == []


def test_main_prints_tables_then_the_json_line(structure, tree: Path, capsys) -> None:
    assert structure.main([str(tree)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert json.loads(out[-1]) == structure.analyze(tree)
    text = "\n".join(out[:-1])
    assert "pstar_core.checkpoint -> pstar_core.engine -> pstar_core.checkpoint" in text
    assert "service/control/jobs.py:5: service imports fastapi (top-level)" in text
    assert "service -> pstar_core: 1 (1 top-level, 0 in functions)" in text


# where code runs decides what it may reach, even through a function-local import: a worker
# or a serving replica never reaches the control plane or the HTTP request schema; what
# every runtime reads (the spec, methods, data, the store) reaches no runtime's own code
CONTROL = ("service.control", "service.spec.request", "api")
RUNTIMES = ("service.control", "service.worker", "service.serving", "api")
REACH = {
    "service.worker": CONTROL,
    "service.serving": CONTROL,
    "service.spec": RUNTIMES,
    "service.methods": (*RUNTIMES, "service.spec.request"),
    "service.data": RUNTIMES,
    "service.store": RUNTIMES,
}


def test_the_real_tree_has_no_import_cycle_and_keeps_its_layers(structure) -> None:
    data = structure.analyze(SCRIPT.parent.parent)
    assert data["parse_errors"] == []
    assert data["cycles"] == [], [c["cycle"] for c in data["cycles"]]
    assert data["violations"] == []


@pytest.mark.parametrize("folder", sorted(REACH))
def test_each_folder_reaches_only_what_runs_beside_it(structure, folder: str) -> None:
    report = structure.load(SCRIPT.parent.parent)
    structure.collect_imports(report)
    graph = structure.module_graph(report)
    entries = [m for m in graph if m == folder or m.startswith(folder + ".")]
    assert entries, f"no module in {folder}"
    seen: dict[str, str] = {m: m for m in entries}
    todo = list(entries)
    while todo:
        here = todo.pop()
        for there in graph.get(here, {}):
            if there not in seen:
                seen[there] = here
                todo.append(there)
    reached = sorted(m for m in seen if m.startswith(REACH[folder]))

    def path(m: str) -> str:
        steps = [m]
        while seen[steps[-1]] != steps[-1]:
            steps.append(seen[steps[-1]])
        return " <- ".join(steps)

    assert reached == [], [path(m) for m in reached]
