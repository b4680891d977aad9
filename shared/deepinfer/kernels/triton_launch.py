"""Triton launches recorded once and launched again with some pointer arguments swapped.

`kernel[grid](*args)` costs ~30-40 us of host time on an H200 host even when the kernel is compiled: Triton binds
the arguments, computes their specialisation and the cache key, looks the kernel up, then launches. A piece of work
that launches the same kernels with the same arguments but for a few pointers (one step's attention, layer after
layer: only the layer's KV cache differs) can pay that once: `LaunchRecorder` launches through `kernel[grid]`
(compiling if need be), keeps the compiled kernel, grid and bound arguments, and `RecordedLaunch` launches that
compiled kernel straight through its launcher with new pointers in the recorded places (~5 us).

Sound only when Triton would specialise the new arguments as the recorded ones: the caller swaps only pointers of
tensors with the recorded dtype and 16-byte alignment, and keeps every other argument the same object or value.
Nothing is recorded (`LaunchRecorder.launches` is None) where the launch is not a plain CUDA launch of a compiled
kernel: under the interpreter (CPU tests), with Triton's launch hooks set (profilers), with asynchronous compiles,
or off CUDA (Ascend's launcher is untested hardware).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from triton import knobs
from triton.runtime import driver


def launch_now(kernel: Any, grid: tuple[int, ...], *args: Any, **kwargs: Any) -> Any:
    """The plain launch: `kernel[grid](*args, **kwargs)`; returns what Triton returns (the compiled kernel)."""
    return kernel[grid](*args, **kwargs)


#: The `launch` argument of the attention functions: (kernel, grid, *args, **kwargs) -> compiled kernel.
Launch = Callable[..., Any]


class RecordedLaunch:
    """One compiled kernel's launch with its grid and bound arguments; `__call__(pointers)` launches it again
    with `pointers[i]` at every argument position that held the recorder's i-th swappable tensor."""

    __slots__ = ("_function", "_grid", "_metadata", "_run", "_slots", "_stream", "args")

    def __init__(self, compiled: Any, grid: tuple[int, ...], args: list[Any], slots: list[list[int]],
                 stream: int) -> None:
        self._run, self._function, self._metadata = compiled.run, compiled.function, compiled.packed_metadata
        self._grid = (*grid, 1, 1)[:3]
        self.args, self._slots, self._stream = args, slots, stream

    def __call__(self, pointers: Sequence[int]) -> None:
        args = self.args
        for slots, pointer in zip(self._slots, pointers, strict=True):
            for slot in slots:
                args[slot] = pointer
        grid_0, grid_1, grid_2 = self._grid
        # launch metadata and enter/exit hooks: None, as Triton passes them when no hook is set
        self._run(grid_0, grid_1, grid_2, self._stream, self._function, self._metadata, None, None, None, *args)


class LaunchRecorder:
    """A `launch` that launches now and records each launch for `RecordedLaunch`; `swappable` are the tensors
    whose pointers a replay replaces (found among the arguments by data pointer, so views count)."""

    def __init__(self, swappable: Sequence[torch.Tensor]) -> None:
        self._pointers = [t.data_ptr() for t in swappable]
        replayable = all(t.device.type == "cuda" for t in swappable) and not _launch_hooks_set()
        #: The recorded launches in order, or None when a launch could not be recorded (see the module doc).
        self.launches: list[RecordedLaunch] | None = [] if replayable else None

    def __call__(self, kernel: Any, grid: tuple[int, ...], *args: Any, **kwargs: Any) -> Any:
        compiled = kernel[grid](*args, **kwargs)
        if self.launches is None:
            return compiled
        if compiled is None or hasattr(compiled, "result") or not hasattr(compiled, "packed_metadata"):
            self.launches = None  # interpreted, or an asynchronous compile's future
            return compiled
        bound = kernel.signature.bind(*args, **{k: v for k, v in kwargs.items() if k in kernel.arg_names})
        bound.apply_defaults()  # Triton's binder passes every parameter, constexprs included, in order
        values = list(bound.arguments.values())
        slots = [[i for i, v in enumerate(values) if isinstance(v, torch.Tensor) and v.data_ptr() == pointer]
                 for pointer in self._pointers]
        stream = driver.active.get_current_stream(driver.active.get_current_device())
        self.launches.append(RecordedLaunch(compiled, grid, values, slots, stream))
        return compiled


def _launch_hooks_set() -> bool:
    """Triton 3.6's launch hooks are HookChains (empty when no hook is set); older Tritons' None or a callable."""
    return any(hook is not None and (not hasattr(hook, "calls") or bool(hook.calls))
               for hook in (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook))
