"""Print the project's structure: sizes, largest classes and functions, the import graph
between top-level packages, import cycles between modules and the layering rules.

    .venv/bin/python scripts/structure.py [ROOT]

ROOT defaults to the repository root. Stdlib only (`ast`): nothing is imported from the
project, so it runs on any checkout, including an old commit in a `git worktree`.

Packages are the directories at ROOT with an `__init__.py` (plus `pstar/` if it exists);
`tests/` and `scripts/` are reported beside them but left out of the overall largest class
and function and of the layering rules. An import statement is *top-level* when it runs at
import time (module or class body), *in functions* when it sits in a function body, and
*type-only* under `if TYPE_CHECKING:`. All three are edges of the module graph: a cycle
closed by a function-local or type-only import is broken at run time, not in the design.

The last line printed is one JSON object with the same data.
"""

from __future__ import annotations

import ast
import json
import sys
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent

# the order packages are listed in; others found at ROOT follow in name order
KNOWN_ORDER = ("pstar_core", "service", "api", "benchmarks", "pstar")
SIDE_GROUPS = ("tests", "scripts")  # reported, not production code
SKIP_DIRS = {"__pycache__", "node_modules", "build", "dist"}
THIRD_PARTY = ("fastapi", "uvicorn", "httpx", "ray", "sqlalchemy")
BIG_CLASS = 350
BIG_FILE = 700

# package -> top-level names it must not import (ARCHITECTURE: the layering)
FORBIDDEN = {
    "pstar_core": (
        "ray",
        "fastapi",
        "sqlalchemy",
        "uvicorn",
        "httpx",
        "service",
        "api",
        "benchmarks",
        "pstar",
    ),
    "service": ("fastapi", "uvicorn", "httpx", "api", "benchmarks", "pstar"),
    "api": ("benchmarks", "pstar"),
}
COMPOSITION_ROOT = "pstar"  # the only package that may import `benchmarks`
# file -> what it may import despite FORBIDDEN, and why
EXCEPTIONS = {
    "service/methods/api_client.py": (
        ("httpx",),
        "a reinforcement job's score_model graders are clients of this service's own API",
    ),
}

KIND_LABEL = {"top": "top-level", "func": "in function", "type": "type-only"}


@dataclass
class Def:
    """A class or function: `name` is qualified (Class.method, outer.inner)."""

    package: str
    file: str
    name: str
    line: int
    lines: int

    def label(self) -> str:
        return f"{self.file}:{self.name} ({self.lines} lines, line {self.line})"

    def as_json(self) -> dict:
        return {
            "package": self.package,
            "file": self.file,
            "name": self.name,
            "line": self.line,
            "lines": self.lines,
        }


@dataclass
class Import:
    """One import statement's target: `target` is a project module when `top` is a
    project package, else the imported name (`top` is its first component)."""

    module: str
    package: str
    file: str
    line: int
    kind: str  # top | func | type
    target: str
    top: str
    stmt: int  # id of the statement, to count statements rather than names


@dataclass
class Module:
    name: str
    package: str
    file: str  # relative to ROOT, with /
    lines: int
    code: int
    is_init: bool
    tree: ast.Module | None = None


@dataclass
class Report:
    root: Path
    packages: list[str] = field(default_factory=list)
    modules: dict[str, Module] = field(default_factory=dict)
    classes: list[Def] = field(default_factory=list)
    functions: list[Def] = field(default_factory=list)
    imports: list[Import] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


# ---------------------------------------------------------------- discovery


def find_packages(root: Path) -> list[str]:
    """Top-level packages (with __init__.py, or pstar/), then tests/ and scripts/."""
    found = []
    for d in sorted(root.iterdir()):
        if not d.is_dir() or d.name.startswith(".") or d.name in SKIP_DIRS:
            continue
        if d.name in SIDE_GROUPS:
            continue
        if (d / "__init__.py").exists() or (d.name == COMPOSITION_ROOT and any(d.glob("*.py"))):
            found.append(d.name)
    rank = {name: i for i, name in enumerate(KNOWN_ORDER)}
    found.sort(key=lambda n: (rank.get(n, len(rank)), n))
    return found + [g for g in SIDE_GROUPS if (root / g).is_dir()]


def python_files(folder: Path) -> list[Path]:
    out = []
    for path in sorted(folder.rglob("*.py")):
        parts = path.relative_to(folder).parts[:-1]
        if any(p.startswith(".") or p in SKIP_DIRS for p in parts):
            continue
        out.append(path)
    return out


def module_name(rel: Path) -> tuple[str, bool]:
    parts = list(rel.with_suffix("").parts)
    is_init = parts[-1] == "__init__"
    if is_init:
        parts.pop()
    return ".".join(parts), is_init


def load(root: Path) -> Report:
    report = Report(root=root)
    report.packages = find_packages(root)
    for package in report.packages:
        for path in python_files(root / package):
            rel = path.relative_to(root)
            text = path.read_text(encoding="utf-8", errors="replace")
            lines = text.splitlines()
            code = sum(1 for s in lines if s.strip() and not s.lstrip().startswith("#"))
            name, is_init = module_name(rel)
            mod = Module(name, package, rel.as_posix(), len(lines), code, is_init)
            try:
                mod.tree = ast.parse(text, filename=str(rel))
            except SyntaxError as e:
                report.errors.append(f"{mod.file}:{e.lineno}: cannot parse: {e.msg}")
            report.modules[name] = mod
    return report


# ---------------------------------------------------------------- definitions


def child_statements(node: ast.AST) -> list[ast.AST]:
    """The statements directly inside a statement (bodies, branches, handlers, cases):
    classes, functions and imports are statements, so expressions are never walked."""
    out: list[ast.AST] = []
    for name in ("body", "orelse", "finalbody"):
        block = getattr(node, name, None)
        if isinstance(block, list):
            out += block
    for handler in getattr(node, "handlers", ()):
        out += handler.body
    for case in getattr(node, "cases", ()):
        out += case.body
    return out


def collect_defs(report: Report) -> None:
    def walk(node: ast.AST, prefix: str, mod: Module) -> None:
        for child in child_statements(node):
            if isinstance(child, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                name = prefix + child.name
                size = (child.end_lineno or child.lineno) - child.lineno + 1
                d = Def(mod.package, mod.file, name, child.lineno, size)
                if isinstance(child, ast.ClassDef):
                    report.classes.append(d)
                else:
                    report.functions.append(d)
                walk(child, name + ".", mod)
            else:
                walk(child, prefix, mod)

    for mod in report.modules.values():
        if mod.tree is not None:
            walk(mod.tree, "", mod)


# ---------------------------------------------------------------- imports


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def import_statements(tree: ast.AST) -> list[tuple[ast.Import | ast.ImportFrom, str]]:
    """Every import statement with where it runs: top | func | type."""
    out: list[tuple[ast.Import | ast.ImportFrom, str]] = []

    def walk(node: ast.AST, func: bool, typ: bool) -> None:
        if isinstance(node, ast.Import | ast.ImportFrom):
            out.append((node, "type" if typ else "func" if func else "top"))
            return
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.body:
                walk(child, func, True)
            for child in node.orelse:
                walk(child, func, typ)
            return
        inner = func or isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        for child in child_statements(node):
            walk(child, inner, typ)

    walk(tree, False, False)
    return out


def _existing(name: str, modules: dict[str, Module]) -> str:
    """The longest prefix of a dotted name that is a project module."""
    parts = name.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in modules:
            return candidate
        parts.pop()
    return name


def resolve(node: ast.Import | ast.ImportFrom, mod: Module, report: Report) -> list[str]:
    """Absolute names an import statement loads: submodules where `from pkg import name`
    names one, relative imports resolved against the importing module's package."""
    modules = report.modules
    project = set(report.packages)
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
        return [_existing(n, modules) if n.split(".")[0] in project else n for n in names]
    if node.level:
        package = mod.name.split(".") if mod.is_init else mod.name.split(".")[:-1]
        if node.level - 1 > len(package) or (node.level - 1 == len(package) and not node.module):
            return []  # beyond the top: not resolvable from ROOT
        base_parts = package[: len(package) - (node.level - 1)]
        if node.module:
            base_parts += node.module.split(".")
        base = ".".join(base_parts)
    else:
        base = node.module or ""
    if base.split(".")[0] not in project:
        return [base]
    out = []
    for alias in node.names:
        sub = f"{base}.{alias.name}"
        out.append(sub if alias.name != "*" and sub in modules else _existing(base, modules))
    return out


def collect_imports(report: Report) -> None:
    stmt = 0
    for mod in report.modules.values():
        if mod.tree is None:
            continue
        for node, kind in import_statements(mod.tree):
            stmt += 1
            seen = set()
            for target in resolve(node, mod, report):
                if not target or target in seen:
                    continue
                seen.add(target)
                report.imports.append(
                    Import(
                        mod.name,
                        mod.package,
                        mod.file,
                        node.lineno,
                        kind,
                        target,
                        target.split(".")[0],
                        stmt,
                    )
                )


# ---------------------------------------------------------------- analyses


def _counts(imports: list[Import]) -> dict[str, int]:
    """Statements (not names) by kind."""
    by_kind = {"top": set(), "func": set(), "type": set()}
    for imp in imports:
        by_kind[imp.kind].add(imp.stmt)
    c = {k: len(v) for k, v in by_kind.items()}
    return {
        "imports": sum(c.values()),
        "top_level": c["top"],
        "in_functions": c["func"],
        "type_only": c["type"],
    }


def package_edges(report: Report) -> dict[str, dict[str, int]]:
    groups: dict[tuple[str, str], list[Import]] = {}
    for imp in report.imports:
        if imp.top in report.packages and imp.top != imp.package:
            groups.setdefault((imp.package, imp.top), []).append(imp)
    rank = {name: i for i, name in enumerate(report.packages)}
    keys = sorted(groups, key=lambda k: (rank[k[0]], rank[k[1]]))
    return {f"{a} -> {b}": _counts(groups[(a, b)]) for a, b in keys}


def third_party(report: Report) -> dict[str, dict[str, dict[str, int]]]:
    out: dict[str, dict[str, dict[str, int]]] = {}
    for package in report.packages:
        for lib in THIRD_PARTY:
            hits = [i for i in report.imports if i.package == package and i.top == lib]
            if hits:
                out.setdefault(package, {})[lib] = _counts(hits)
    return out


def module_graph(report: Report) -> dict[str, dict[str, list[Import]]]:
    graph: dict[str, dict[str, list[Import]]] = {name: {} for name in report.modules}
    for imp in report.imports:
        if imp.target in report.modules and imp.target != imp.module:
            graph[imp.module].setdefault(imp.target, []).append(imp)
    return graph


def strongly_connected(graph: dict[str, dict[str, list[Import]]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative; components in discovery order, members sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def enter(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)

    for start in sorted(graph):
        if start in index:
            continue
        enter(start)
        work = [(start, iter(sorted(graph[start])))]
        while work:
            node, successors = work[-1]
            for nxt in successors:
                if nxt not in index:
                    enter(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    out.append(sorted(component))
    return out


def shortest_cycle(graph: dict[str, dict[str, list[Import]]], members: list[str]) -> list[str]:
    """A shortest cycle through the first member, staying inside the component."""
    start = members[0]
    inside = set(members)
    prev: dict[str, str] = {}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        for nxt in sorted(graph[node]):
            if nxt == start:
                path = [node]
                while path[-1] != start:
                    path.append(prev[path[-1]])
                return [*reversed(path), start]
            if nxt in inside and nxt not in prev:
                prev[nxt] = node
                queue.append(nxt)
    return [start]


def cycles(report: Report) -> list[dict]:
    graph = module_graph(report)
    out = []
    for members in strongly_connected(graph):
        if len(members) < 2:
            continue
        edges = []
        for a in members:
            for b in sorted(graph[a]):
                if b in members:
                    imps = sorted({(i.file, i.line, i.kind) for i in graph[a][b]})
                    edges.append(
                        {
                            "from": a,
                            "to": b,
                            "at": [f"{f}:{line} ({KIND_LABEL[k]})" for f, line, k in imps],
                        }
                    )
        out.append({"modules": members, "cycle": shortest_cycle(graph, members), "edges": edges})
    out.sort(key=lambda c: (-len(c["modules"]), c["modules"]))
    return out


def violations(report: Report) -> list[dict]:
    production = [p for p in report.packages if p not in SIDE_GROUPS]
    out = []
    seen = set()
    for imp in report.imports:
        if imp.package not in production:
            continue
        rule = None
        if imp.top in EXCEPTIONS.get(imp.file, ((), ""))[0]:
            continue
        if imp.top in FORBIDDEN.get(imp.package, ()):
            rule = f"{imp.package} must not import {', '.join(FORBIDDEN[imp.package])}"
        elif imp.top == "benchmarks" and imp.package not in (COMPOSITION_ROOT, "benchmarks"):
            rule = f"only {COMPOSITION_ROOT} imports benchmarks"
        key = (imp.stmt, imp.top)
        if rule is None or key in seen:
            continue
        seen.add(key)
        out.append(
            {
                "package": imp.package,
                "file": imp.file,
                "line": imp.line,
                "imports": imp.target,
                "kind": KIND_LABEL[imp.kind],
                "rule": rule,
            }
        )
    out.sort(key=lambda v: (v["file"], v["line"], v["imports"]))
    return out


def _largest(defs: list[Def]) -> Def | None:
    return max(defs, key=lambda d: (d.lines, -d.line), default=None)


def analyze(root: Path | str) -> dict:
    """Everything the script prints, as the JSON object of its last line."""
    report = load(Path(root).resolve())
    collect_defs(report)
    collect_imports(report)
    production = [p for p in report.packages if p not in SIDE_GROUPS]

    packages = {}
    for package in report.packages:
        mods = [m for m in report.modules.values() if m.package == package]
        big_class = _largest([d for d in report.classes if d.package == package])
        big_func = _largest([d for d in report.functions if d.package == package])
        packages[package] = {
            "files": len(mods),
            "lines": sum(m.lines for m in mods),
            "code": sum(m.code for m in mods),
            "production": package in production,
            "largest_class": big_class.as_json() if big_class else None,
            "largest_function": big_func.as_json() if big_func else None,
        }
    big_class = _largest([d for d in report.classes if d.package in production])
    big_func = _largest([d for d in report.functions if d.package in production])
    files = sorted(report.modules.values(), key=lambda m: (-m.lines, m.file))
    return {
        "root": str(report.root),
        "packages": packages,
        "largest_class": big_class.as_json() if big_class else None,
        "largest_function": big_func.as_json() if big_func else None,
        "classes_over_350": [
            d.as_json()
            for d in sorted(report.classes, key=lambda d: (-d.lines, d.file, d.line))
            if d.lines > BIG_CLASS
        ],
        "files_over_700": [
            {"package": m.package, "file": m.file, "lines": m.lines}
            for m in files
            if m.lines > BIG_FILE
        ],
        "package_edges": package_edges(report),
        "third_party": third_party(report),
        "cycles": cycles(report),
        "violations": violations(report),
        "parse_errors": report.errors,
    }


# ---------------------------------------------------------------- printing


def table(headers: list[str], rows: list[list]) -> list[str]:
    cells = [headers] + [["" if c is None else str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    numeric = [bool(rows) and all(str(r[i]).isdigit() for r in rows) for i in range(len(headers))]

    def fmt(row: list[str]) -> str:
        parts = [
            c.rjust(w) if num else c.ljust(w)
            for c, w, num in zip(row, widths, numeric, strict=True)
        ]
        return "  ".join(parts).rstrip()

    return [fmt(cells[0]), "  ".join("-" * w for w in widths)] + [fmt(r) for r in cells[1:]]


def _split(c: dict[str, int]) -> str:
    text = f"{c['imports']} ({c['top_level']} top-level, {c['in_functions']} in functions"
    if c["type_only"]:
        text += f", {c['type_only']} type-only"
    return text + ")"


def _def_label(d: dict | None) -> str:
    return "" if d is None else f"{d['file']}:{d['name']} ({d['lines']})"


def render(data: dict) -> list[str]:
    out = [f"Project structure of {data['root']}", ""]

    out.append("1. Packages (lines: all lines; code: not blank, not only a comment)")
    rows = []
    total = [0, 0, 0]
    for name, p in data["packages"].items():
        label = name if p["production"] else f"{name} (not product)"
        rows.append([label, p["files"], p["lines"], p["code"]])
        if p["production"]:
            total = [total[0] + p["files"], total[1] + p["lines"], total[2] + p["code"]]
    rows.append(["total of the packages", *total])
    out += table(["package", "files", "lines", "code"], rows)

    out += ["", "2. Largest class and function (lines from `def`/`class` to its end)"]
    out.append(f"   largest class of the packages:    {_def_label(data['largest_class'])}")
    out.append(f"   largest function of the packages: {_def_label(data['largest_function'])}")
    rows = [
        [name, _def_label(p["largest_class"]), _def_label(p["largest_function"])]
        for name, p in data["packages"].items()
    ]
    out += table(["package", "largest class (lines)", "largest function (lines)"], rows)
    out += ["", f"   classes over {BIG_CLASS} lines: {len(data['classes_over_350'])}"]
    for d in data["classes_over_350"]:
        out.append(f"     {d['lines']:>5}  {d['file']}:{d['name']} (line {d['line']})")
    out.append(f"   files over {BIG_FILE} lines: {len(data['files_over_700'])}")
    for f in data["files_over_700"]:
        out.append(f"     {f['lines']:>5}  {f['file']}")

    out += ["", "3. Imports between packages (statements; in functions = inside a def)"]
    for edge, c in data["package_edges"].items():
        out.append(f"   {edge}: {_split(c)}")
    if not data["package_edges"]:
        out.append("   none")
    out += ["", f"   third-party imports of interest ({', '.join(THIRD_PARTY)})"]
    for package, libs in data["third_party"].items():
        for lib, c in libs.items():
            out.append(f"   {package} -> {lib}: {_split(c)}")
    if not data["third_party"]:
        out.append("   none")

    out += ["", "4. Import cycles between modules (any import is an edge, also in functions)"]
    if not data["cycles"]:
        out.append("   none")
    for n, c in enumerate(data["cycles"], 1):
        out.append(f"   cycle {n}: {len(c['modules'])} modules: {', '.join(c['modules'])}")
        out.append(f"     e.g. {' -> '.join(c['cycle'])}")
        for e in c["edges"]:
            out.append(f"     {e['from']} -> {e['to']}: {', '.join(e['at'])}")

    out += ["", "5. Layering violations"]
    for rule_package, names in FORBIDDEN.items():
        out.append(f"   rule: {rule_package} imports none of {', '.join(names)}")
    out.append(f"   rule: only {COMPOSITION_ROOT} imports benchmarks (tests and scripts exempt)")
    for file, (names, why) in EXCEPTIONS.items():
        out.append(f"   except: {file} imports {', '.join(names)} ({why})")
    if not data["violations"]:
        out.append("   no violations")
    for v in data["violations"]:
        out.append(
            f"   {v['file']}:{v['line']}: {v['package']} imports {v['imports']} ({v['kind']})"
        )

    if data["parse_errors"]:
        out += ["", "Files that could not be parsed:"]
        out += [f"   {e}" for e in data["parse_errors"]]
    return out


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) > 1 or (args and args[0] in ("-h", "--help")):
        print(__doc__)
        return 0 if args and args[0] in ("-h", "--help") else 2
    root = Path(args[0]) if args else REPO_ROOT
    if not root.is_dir():
        print(f"not a directory: {root}", file=sys.stderr)
        return 2
    data = analyze(root)
    print("\n".join(render(data)))
    print()
    print(json.dumps(data, separators=(",", ":")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
