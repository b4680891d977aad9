"""Triton compiles counted and timed, per process: a compile after the engine is ready is a request waiting on it.

Triton compiles one binary per kernel and specialization (constexprs, and whether each int argument is 1 or a
multiple of 16) on the first launch that needs it: up to ~1 s each on a fresh machine, on the engine thread,
in the middle of a step. The engine compiles what it can foresee at start (`ModelRunner.warm_up`, the CUDA
graphs' capture) and marks the kernels' step-varying ints `do_not_specialize`; this watch shows what is left:

    watch = install()            # once per process (the hooks are Triton's global knobs)
    with watch.starting():       # load, capture, warm up: compiles counted as the start's
        ...
    # from here on every compile is logged as a warning with its kernel and time (another engine starting in
    # the same process counts its compiles as its start's)

A compile found in Triton's on-disk cache takes milliseconds and is counted the same way.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

log = logging.getLogger(__name__)


class CompileWatch:
    """Compile counts and seconds before and after `mark_ready()`."""

    def __init__(self) -> None:
        self.ready = False
        self.start_compiles = 0
        self.serving_compiles = 0
        self.serving_seconds = 0.0
        self._started: dict[int, float] = {}
        self._starting = 0

    @contextlib.contextmanager
    def starting(self) -> Iterator[None]:
        """An engine's start: compiles within are the start's; once one engine has started, compiles outside
        every start happen on a request's path, and each is logged."""
        with _LOCK:
            self._starting += 1
        try:
            yield
        finally:
            with _LOCK:
                self._starting -= 1
                self.ready = True

    @property
    def serving(self) -> bool:
        """An engine is ready and none is starting."""
        return self.ready and not self._starting

    def on_start(self, **_: Any) -> None:
        """Triton's jit_cache_hook: a specialization is missing from the in-memory cache (None: compile it)."""
        self._started[threading.get_ident()] = time.perf_counter()

    def on_compiled(self, *, fn: Any = None, repr: str = "", **_: Any) -> None:  # noqa: A002 (Triton's name)
        """Triton's jit_post_compile_hook."""
        started = self._started.pop(threading.get_ident(), None)
        seconds = 0.0 if started is None else time.perf_counter() - started
        if not self.serving:
            self.start_compiles += 1
            return
        self.serving_compiles += 1
        self.serving_seconds += seconds
        name = getattr(fn, "name", None) or repr.split("[", 1)[0]
        log.warning("Triton compiled %s while serving (%.3f s; a step waited for it): %s", name, seconds,
                    repr[:400])


_WATCH: CompileWatch | None = None
_LOCK = threading.Lock()


def install() -> CompileWatch:
    """The process's watch, its hooks installed on first call (hooks someone else set are left alone)."""
    global _WATCH
    with _LOCK:
        if _WATCH is None:
            _WATCH = CompileWatch()
            try:
                from triton import knobs
            except ImportError:  # no Triton (or one without knobs): nothing compiles, nothing to watch
                return _WATCH
            runtime = knobs.runtime
            if runtime.jit_cache_hook is None and runtime.jit_post_compile_hook is None:
                runtime.jit_cache_hook = _WATCH.on_start
                runtime.jit_post_compile_hook = _WATCH.on_compiled
        return _WATCH
