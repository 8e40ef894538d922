"""Session-wide pytest setup, and the one way tests import a program file.

Triton decides between compiling and interpreting when a kernel is defined, so the
choice must be made before any test module imports triton or uvic_kernels: without
CUDA, kernels run in Triton's CPU interpreter (TRITON_INTERPRET=1); with CUDA they
are compiled.  An explicit TRITON_INTERPRET in the environment is kept.

`load_script("scripts/quickstart.py")` imports a program of the checkout (scripts/ and
eval/ are not packages); test files import it with `from conftest import load_script`
(pytest puts tests/ on sys.path, as for `datagen`).
"""

import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

REPO = Path(__file__).resolve().parents[1]


def load_script(path: str) -> ModuleType:
    """The program file `path` (relative to the repository root) as a module, imported once:
    registered in sys.modules as e.g. `scripts_quickstart` (dataclasses look their module
    up there), so later calls return the same module, as `import` would."""
    name = path.removesuffix(".py").replace("/", "_")
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, REPO / path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module
