"""Our Triton kernel modules on the CPU, in Triton's interpreter (how CI covers the kernels without a GPU)."""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
from collections.abc import Iterator, Sequence
from types import SimpleNamespace


def _reimported(name: str) -> bool:
    """Modules imported afresh: triton's Python modules (not its C extension) and our Triton kernels."""
    return name == "triton" or (name.startswith("triton.") and not name.startswith("triton._C")) or (
        name.startswith("deepinfer.kernels.triton_")
    )


def _fix_interpreter_index(interpreter) -> None:
    """Triton 3.6's interpreter calls int() on 1-element arrays, an error since numpy 2.4 (triton#9171)."""
    original = interpreter._patch_lang_tensor

    def patch_lang_tensor(tensor, scope) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patch_lang_tensor


@contextlib.contextmanager
def interpreted_kernels(module_names: Sequence[str]) -> Iterator[SimpleNamespace]:
    """`deepinfer.kernels.<name>` for each name, imported with TRITON_INTERPRET=1 on a fresh triton (another test
    may have imported triton for real first), as one namespace; the previous modules are put back on exit."""
    import deepinfer.kernels as kernels_package

    saved = {name: sys.modules.pop(name) for name in list(sys.modules) if _reimported(name)}
    previous_env = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        import triton.runtime.interpreter as interpreter

        _fix_interpreter_index(interpreter)
        yield SimpleNamespace(**{m: importlib.import_module(f"deepinfer.kernels.{m}") for m in module_names})
    finally:
        for name in [name for name in sys.modules if _reimported(name)]:
            del sys.modules[name]
        sys.modules.update(saved)
        for attr in [a for a in vars(kernels_package) if a.startswith("triton_")]:
            delattr(kernels_package, attr)
        for name, module in saved.items():
            if name.startswith("deepinfer.kernels."):
                setattr(kernels_package, name.rsplit(".", 1)[1], module)
        if previous_env is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = previous_env
