"""Dependencies flow one way (docs/architecture.md, "Layers").

Read from the source with `ast`, without importing anything: every import among the
modules of `uvic/` and `kernels/` (`uvic_kernels`), at module level and inside
functions, must point to the importer's layer or a lower one and close no cycle; every
import of them anywhere in the repository (scripts, configs, tests too) must resolve.
The layers are the table of docs/architecture.md, read here; the rules folder
(`uvic/config/`) imports nothing above it, and the schema, the rules on values and the
command-line choices load without torch.

What counts as an import of a module (the rules of `resolve_imports`):
* `import a.b.c` imports `a.b.c`; `from a.b import c` imports `a.b.c` when that is a
  module, else the package `a.b` (its `__init__`, where the name `c` lives).
* Parent packages are not counted: Python runs `a/__init__.py` and `a/b/__init__.py`
  before `a.b.c`, but a package `__init__` that re-exports its own modules (a facade,
  as `uvic/analysis/__init__.py`) would otherwise make every such package a cycle.
  A facade imports downward only, which the layer check holds it to.
* Imports under `if TYPE_CHECKING:` are not counted (they never run).
"""

from __future__ import annotations

import ast
import functools
import itertools
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = {"uvic": REPO / "uvic", "uvic_kernels": REPO / "kernels"}

ARCHITECTURE = REPO / "docs" / "architecture.md"


def read_layers(text: str) -> list[tuple[str, ...]]:
    """The layers of docs/architecture.md's "Layers" table, lowest first, as module names:
    a row's folders and files in its second column (`uvic/config/` is `uvic.config` and
    everything under it, `kernels/` is `uvic_kernels`, `uvic/__init__.py` is `uvic`)."""
    section = text.split("## Layers", 1)[1].split("\n## ", 1)[0]
    layers = []
    for row in section.splitlines():
        cells = [c.strip() for c in row.strip().strip("|").split("|")]
        if len(cells) < 3 or not cells[0][:1].isdigit():
            continue
        names = []
        for path in re.findall(r"`([^`]+)`", cells[1]):
            path = path.removesuffix("/").removesuffix(".py").removesuffix("/__init__")
            package, _, rest = path.partition("/")
            names.append(".".join([{"kernels": "uvic_kernels"}.get(package, package),
                                   *filter(None, rest.split("/"))]))
        layers.append(tuple(names))
    return layers


# A module imports only from its own layer or lower ones; a name matches a module and
# everything under it.
LAYERS = read_layers(ARCHITECTURE.read_text())
PUBLIC_API = "uvic"  # uvic/__init__.py, a facade over all layers: in the top one (exactly)
RULES = "uvic.config"  # the schema and the rules on values: import nothing above them
# Modules that must load without torch (argparse choices, `--help`, config checks).
LIGHT = ["uvic.config", "uvic.config.validation", "uvic.config.models", "uvic.config.data",
         "uvic.config.diffusion", "uvic.config.sampling", "uvic.config.training",
         "uvic.config.evaluation", "uvic.config.compare"]


def find_modules() -> dict[str, Path]:
    """Dotted module name -> source file, for every .py under the packages."""
    modules = {}
    for package, root in PACKAGES.items():
        for path in sorted(root.rglob("*.py")):
            parts = [package, *path.relative_to(root).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    return modules


MODULES = find_modules()


def _is_package(name: str) -> bool:
    return MODULES[name].name == "__init__.py"


def _type_checking_only(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement, at any depth, except those under `if TYPE_CHECKING:`."""
    found, todo = [], [tree]
    while todo:
        node = todo.pop()
        if isinstance(node, ast.If) and _type_checking_only(node):
            todo.extend(node.orelse)
            continue
        if isinstance(node, ast.Import | ast.ImportFrom):
            found.append(node)
        todo.extend(ast.iter_child_nodes(node))
    return sorted(found, key=lambda n: n.lineno)


def _bound_names(tree: ast.Module) -> set[str] | None:
    """Names a module binds at top level (inside if/try/with too); None when it defines a
    module `__getattr__` (any name may then exist)."""
    names: set[str] = set()
    todo = list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, ast.FunctionDef) and node.name == "__getattr__":
            return None
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, ast.Assign | ast.AnnAssign | ast.AugAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
        elif isinstance(node, ast.If | ast.Try | ast.With):
            todo.extend(ast.iter_child_nodes(node))
        elif isinstance(node, ast.ExceptHandler):
            todo.extend(node.body)
    return names


def _shown(path: Path) -> str:
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)


@functools.cache
def _parse(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def import_edges(name: str) -> dict[str, int]:
    """The modules of PACKAGES that module `name` imports: target -> line of the first."""
    edges, _ = resolve_imports(MODULES[name], name)
    edges.pop(name, None)
    return edges


def resolve_imports(path: Path, name: str | None = None) -> tuple[dict[str, int], list[str]]:
    """The modules of PACKAGES that the file imports (target -> first line), and the
    imports that resolve to nothing (an ImportError waiting for its code path). `name`:
    the file's module name, for relative imports."""
    edges: dict[str, int] = {}
    broken: list[str] = []
    aliases: dict[str, str] = {}  # a name bound to one of our modules -> that module
    where = _shown(path)
    for node in _imports(_parse(path)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] not in PACKAGES:
                    continue
                if alias.name in MODULES:
                    edges.setdefault(alias.name, node.lineno)
                    if alias.asname:
                        aliases[alias.asname] = alias.name
                else:
                    broken.append(f"{where}:{node.lineno}: no module {alias.name}")
            continue
        if node.level:  # relative: from the importer's package
            assert name is not None, f"{where}:{node.lineno}: relative import outside a package"
            base = name.split(".") if _is_package(name) else name.split(".")[:-1]
            base = base[:len(base) - node.level + 1]
            source = ".".join(base + ([node.module] if node.module else []))
        else:
            source = node.module or ""
        if source.split(".")[0] not in PACKAGES:
            continue
        if source not in MODULES:
            broken.append(f"{where}:{node.lineno}: no module {source}")
            continue
        for alias in node.names:
            sub = f"{source}.{alias.name}"
            if sub in MODULES:
                edges.setdefault(sub, node.lineno)
                aliases[alias.asname or alias.name] = sub
                continue
            edges.setdefault(source, node.lineno)
            bound = _bound_names(_parse(MODULES[source]))
            if alias.name != "*" and bound is not None and alias.name not in bound:
                broken.append(f"{where}:{node.lineno}: {source} has no {alias.name!r}")
    return edges, broken + _missing_attributes(path, aliases)


def _missing_attributes(path: Path, aliases: dict[str, str]) -> list[str]:
    """`alias.name` uses of an imported module of ours whose module binds no `name` (a
    module that became a package keeps its import working but loses its names)."""
    missing = {}
    for node in ast.walk(_parse(path)):
        if not (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                and node.value.id in aliases):
            continue
        module = aliases[node.value.id]
        bound = _bound_names(_parse(MODULES[module]))
        if bound is not None and node.attr not in bound and f"{module}.{node.attr}" not in MODULES:
            missing.setdefault((module, node.attr), node.lineno)
    return [f"{_shown(path)}:{line}: {module} has no {attr!r}"
            for (module, attr), line in missing.items()]


GRAPH = {name: import_edges(name) for name in MODULES}


def find_cycle(graph: dict[str, dict[str, int]]) -> list[str] | None:
    """One import cycle as [a, b, ..., a], or None (depth-first search, colours)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for target in sorted(graph.get(node, {})):
            if state.get(target) == 1:
                return [*path[path.index(target):], target]
            if target not in state and (cycle := visit(target)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start)):
            return cycle
    return None


def describe(cycle: list[str], graph: dict[str, dict[str, int]]) -> str:
    """`a (uvic/a.py:12) -> b (...) -> a`: each step with the line of its import."""
    steps = [f"{a} ({MODULES[a].relative_to(REPO)}:{graph[a][b]})"
             for a, b in itertools.pairwise(cycle)]
    return " -> ".join([*steps, cycle[-1]])


def layer_of(name: str) -> int:
    """Index in LAYERS of the longest name that `name` is or lies under (-1: none)."""
    if name == PUBLIC_API:
        return len(LAYERS) - 1
    best, level = "", -1
    for i, names in enumerate(LAYERS):
        for prefix in names:
            if prefix == PUBLIC_API:  # the facade alone, not everything under uvic
                continue
            if (name == prefix or name.startswith(prefix + ".")) and len(prefix) > len(best):
                best, level = prefix, i
    return level


# --------------------------------------------------------------------------- the checks


def test_what_counts_as_an_import(tmp_path: Path) -> None:
    """The reader's rules on a made-up file: module and function level, `from package
    import module`, no TYPE_CHECKING imports; what does not exist is named with its line."""
    source = tmp_path / "example.py"
    source.write_text(
        "from typing import TYPE_CHECKING\n"
        "import uvic.files\n"
        "from uvic.config import Config\n"
        "from uvic.config import data as data_checks\n"
        "if TYPE_CHECKING:\n"
        "    from uvic.training.trainer import Trainer\n"
        "def later():\n"
        "    from uvic.config.diffusion import NAMED\n"
        "    import uvic.nowhere\n"
        "    from uvic.config import nothing\n"
        "    return data_checks.DATASETS, data_checks.NOTHING\n")
    edges, broken = resolve_imports(source)
    assert edges == {"uvic.files": 2, "uvic.config": 3, "uvic.config.data": 4,
                     "uvic.config.diffusion": 8}
    assert broken == [f"{source}:9: no module uvic.nowhere",
                      f"{source}:10: uvic.config has no 'nothing'",
                      f"{source}:11: uvic.config.data has no 'NOTHING'"]
    assert GRAPH["uvic.config.validation"]["uvic.config"]  # the tree is read the same way


def test_no_import_cycle() -> None:
    """No cycle among the modules of uvic/ and kernels/, module or function level."""
    cycle = find_cycle(GRAPH)
    assert cycle is None, f"import cycle: {describe(cycle, GRAPH)}"


def test_find_cycle_reports_the_path() -> None:
    """The cycle check names every module and line of a cycle (here: made up)."""
    graph = {"uvic.config": {"uvic.diffusion.samplers": 279},
             "uvic.diffusion.samplers": {"uvic.diffusion.schedule": 51},
             "uvic.diffusion.schedule": {"uvic.config": 29}, "uvic.seeds": {}}
    assert find_cycle(graph) == ["uvic.config", "uvic.diffusion.samplers",
                                 "uvic.diffusion.schedule", "uvic.config"]
    assert describe(find_cycle(graph), graph) == (
        "uvic.config (uvic/config/__init__.py:279) -> uvic.diffusion.samplers "
        "(uvic/diffusion/samplers.py:51) -> uvic.diffusion.schedule "
        "(uvic/diffusion/schedule.py:29) -> uvic.config")
    assert find_cycle({"uvic.config": {"uvic.seeds": 1}, "uvic.seeds": {}}) is None


@pytest.mark.slow
def test_every_import_resolves() -> None:
    """An import of a uvic module or name that does not exist (e.g. one left behind by a
    move, in a code path the tests may not reach) is named with its line: in the
    packages, and in the scripts, configs, evaluation drivers and tests that use them."""
    names = {path: name for name, path in MODULES.items()}
    files = sorted(p for p in REPO.rglob("*.py")
                   if not any(part.startswith(".") for part in p.relative_to(REPO).parts))
    broken = [line for path in files for line in resolve_imports(path, names.get(path))[1]]
    assert not broken, "\n".join(broken)


def test_imports_flow_down_the_layers() -> None:
    """Every import goes to the importer's layer or a lower one (LAYERS, the docs')."""
    unplaced = sorted(name for name in MODULES if layer_of(name) < 0)
    assert not unplaced, f"modules in no layer of LAYERS: {unplaced}"
    upward = [f"{MODULES[a].relative_to(REPO)}:{line}: {a} (layer {layer_of(a)}) imports "
              f"{b} (layer {layer_of(b)})"
              for a, targets in GRAPH.items() for b, line in targets.items()
              if layer_of(b) > layer_of(a)]
    assert not upward, "\n".join(upward)


def test_the_layers_are_the_docs_table() -> None:
    """The table is read as written: six layers, the rules folder at the bottom, the
    programs on top, each folder of uvic/ in exactly one layer."""
    assert LAYERS[0][0] == RULES and len(LAYERS) == 6, LAYERS
    assert LAYERS[-1] == ("uvic.cli", PUBLIC_API)
    placed = [name for layer in LAYERS for name in layer]
    folders = {f"uvic.{p.name}" for p in (REPO / "uvic").iterdir()
               if p.is_dir() and (p / "__init__.py").is_file()}
    assert folders <= set(placed) and len(placed) == len(set(placed))


def test_rules_import_nothing_above_them() -> None:
    """uvic/config/ (the schema, the rules on values, validation, comparison) imports
    nothing of uvic outside itself: the bottom layer."""
    for name in MODULES:
        if name == RULES or name.startswith(RULES + "."):
            outside = [t for t in GRAPH[name] if t.split(".")[0] == "uvic"
                       and t != RULES and not t.startswith(RULES + ".")]
            assert not outside, f"{name} imports {outside}"


def test_rules_import_only_the_schema_and_each_other() -> None:
    """The rules modules import only the schema, each other and the kernels' list of
    attention modes at module level (anything heavy they need, in functions)."""
    for name in LIGHT[1:]:
        tree = _parse(MODULES[name])
        top = [n for n in tree.body if isinstance(n, ast.Import | ast.ImportFrom)]
        mods = {a.name for n in top if isinstance(n, ast.Import) for a in n.names}
        mods |= {n.module for n in top if isinstance(n, ast.ImportFrom) and n.module}
        ours = {m for m in mods if m.split(".")[0] in PACKAGES}
        # the kernels' list of attention modes (no torch there) is the one the rules read
        assert ours <= {"uvic.config", "uvic_kernels.modes", *LIGHT}, f"{name} imports {ours}"


@pytest.mark.parametrize("extra", ["", "cfg = Config(); validate(cfg)"])
def test_schema_rules_and_choices_load_without_torch(extra: str) -> None:
    """The schema, the rules modules (the allowed values that argparse offers as choices)
    and validating the default config import neither torch nor diffusers."""
    code = (f"import sys; import {', '.join(LIGHT)}\n"
            "from uvic.config import Config\nfrom uvic.config.validation import validate\n"
            f"{extra}\n"
            "heavy = sorted(m for m in ('torch', 'diffusers', 'cleanfid', 'numpy') "
            "if m in sys.modules)\n"
            "assert not heavy, heavy\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=REPO)
    assert run.returncode == 0, run.stderr
