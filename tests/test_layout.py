"""One of each helper: one atomic `write_json` (uvic.files), and one way tests load a
program file (conftest.load_script). File sizes are left to judgement, not to a test.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODULES = sorted((REPO / "uvic").rglob("*.py"))


def functions(tree: ast.AST) -> list[ast.FunctionDef | ast.AsyncFunctionDef]:
    """Every function and method of a module, nested ones included."""
    return [node for node in ast.walk(tree)
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)]


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
