"""Differences between the Triton releases the kernels run under (3.6 to the pinned 3.8),
detected by behaviour, never by version strings.

``fix_interpreter_scalar_index``: Triton 3.6's interpreter (``TRITON_INTERPRET=1``) turns a
scalar kernel argument into a one-element array whose ``__index__`` numpy >= 2.4 refuses,
and every ``range(lo, hi, BLOCK)`` over runtime bounds in our kernels calls it.  Where it
fails, interpreted calls get an ``__index__`` that reads the single element.
"""

from __future__ import annotations

import types
from typing import Any

_PATCHED = "_uvic_scalar_index"  # marks the wrapper: installed once per process


def _scalar_index(self: Any) -> int:
    """``__index__`` of an interpreted scalar: its one element, whatever the array's rank."""
    return int(self.handle.data.item())


def _index_of(patch_lang_tensor: Any) -> Any:
    """The ``__index__`` that ``patch_lang_tensor(tensor, scope)`` installs (None: it does
    not install one the expected way)."""
    installed: dict[str, Any] = {}

    class Scope:  # records instead of patching: nothing is changed
        def set_attr(self, obj: object, name: str, value: object) -> None:
            installed[name] = value

    class Probe:
        pass

    try:
        patch_lang_tensor(Probe, Scope())
    except Exception:
        return None
    return installed.get("__index__")


def interpreter_index_fails(patch_lang_tensor: Any) -> bool:
    """Whether the interpreter's ``__index__`` refuses a one-element scalar (numpy >= 2.4
    with a Triton interpreter that calls ``int()`` on the array)."""
    import numpy as np

    index = _index_of(patch_lang_tensor)
    if index is None:
        return False
    probe = types.SimpleNamespace(handle=types.SimpleNamespace(data=np.array([3], np.int32)))
    try:
        return index(probe) != 3
    except TypeError:
        return True


def fix_interpreter_scalar_index() -> bool:
    """Install the one-element ``__index__`` in Triton's interpreter where its own fails;
    returns whether it did (now or earlier in this process)."""
    try:
        from triton.runtime import interpreter
    except ImportError:  # pragma: no cover - a Triton without an interpreter
        return False
    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None:
        return False
    if getattr(original, _PATCHED, False):
        return True
    if not interpreter_index_fails(original):
        return False

    def patch_lang_tensor(tensor: Any, scope: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(tensor, scope, *args, **kwargs)
        scope.set_attr(tensor, "__index__", _scalar_index)  # restored with Triton's own
        return result

    setattr(patch_lang_tensor, _PATCHED, True)
    interpreter._patch_lang_tensor = patch_lang_tensor
    return True
