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
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

# Under pytest-xdist (`make test` runs one worker per core) each worker and the programs
# it starts get one thread: two workers of two threads each on two cores run many times
# slower. Set before torch loads, as OpenMP reads it once.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ["MKL_NUM_THREADS"] = "1"

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def torch_process_settings() -> Iterator[None]:
    """Every test gets torch's thread count and deterministic mode back as they were: a
    command run in-process (the quickstart's, uvic-compare's, a capacity cell) fixes them
    for the whole process, and later tests compare in-process results with those of
    subprocesses, which a changed thread count would change in the last bits."""
    threads, deterministic = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    yield
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(deterministic)


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

