"""The package's shape (issue 23): size limits on `uvic/`, and one of each helper.

No module under uvic/ over 400 lines and no function over 80 (the Triton JIT kernels live
in kernels/, outside uvic/); one atomic `write_json` (uvic.files); one way tests load a
program file (conftest.load_script).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
MODULES = sorted((REPO / "uvic").rglob("*.py"))
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 80


def functions(tree: ast.AST) -> list[ast.FunctionDef | ast.AsyncFunctionDef]:
    """Every function and method of a module, nested ones included."""
    return [node for node in ast.walk(tree)
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)]


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(REPO)))
def test_module_and_function_sizes(path: Path) -> None:
    source = path.read_text()
    lines = len(source.splitlines())
    assert lines <= MAX_MODULE_LINES, f"{path.relative_to(REPO)}: {lines} lines"
    long = {f"{node.name} (line {node.lineno}): {node.end_lineno - node.lineno + 1} lines"
            for node in functions(ast.parse(source))
            if node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES}
    assert not long, f"{path.relative_to(REPO)}: {sorted(long)}"


def test_size_check_sees_every_function() -> None:
    """The check counts methods and nested functions, first line to last."""
    tree = ast.parse("class A:\n    def f(self):\n        def g():\n            pass\n"
                     "        return g\n")
    assert [(f.name, f.end_lineno - f.lineno + 1) for f in functions(tree)] == [("f", 4),
                                                                               ("g", 2)]


def test_one_write_json() -> None:
    """JSON files are written by uvic.files.write_json (atomic) and nothing else."""
    files = [*MODULES, *(REPO / "scripts").glob("*.py"), *(REPO / "eval").glob("*.py")]
    defined = [str(path.relative_to(REPO)) for path in files
               if any(f.name == "write_json" for f in functions(ast.parse(path.read_text())))]
    assert defined == ["uvic/files.py"]


def test_one_script_loader_in_the_tests() -> None:
    """Test files import program files with conftest.load_script, not their own loader."""
    users = [path.name for path in sorted((REPO / "tests").glob("*.py"))
             if "spec_from_file_location" in path.read_text() and path.name != Path(__file__).name]
    assert users == ["conftest.py"]
