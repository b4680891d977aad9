"""Receive buffers for blocks: uninitialised, and their fresh pages faulted in with one system call.

A block the store keeps in RAM is received into memory it then holds. While the RAM tier grows, that memory is
fresh: its first touch (the kernel's copy of the socket's bytes) takes one page fault per 4 KiB page, 512 for a
2 MiB block, ~0.55 s per GB on the development VM. `madvise(MADV_POPULATE_WRITE)` (Linux 5.14+) maps the same pages
in one call, ~0.36 s per GB. Memory the allocator reuses (a full RAM tier) is already mapped: `mincore` says so,
and nothing more is done. Anywhere else (no Linux, an older kernel) the buffer is only allocated.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import sys

import numpy

#: madvise advice (Linux 5.14+): populate (prefault) page tables writable, as a write would.
MADV_POPULATE_WRITE = 23
#: Buffers smaller than this are left alone (a few pages: the faults cost less than the calls).
MIN_PREFAULT_BYTES = 256 * 1024
_PAGE = mmap.PAGESIZE


def _libc_calls() -> tuple | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        madvise, mincore = libc.madvise, libc.mincore
    except (OSError, AttributeError):
        return None
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    return madvise, mincore


_CALLS = _libc_calls()


def block_buffer(size: int) -> memoryview:
    """A writable, uninitialised byte buffer of `size` bytes (numpy.empty), its pages mapped when fresh."""
    array = numpy.empty(size, dtype=numpy.uint8)
    if size >= MIN_PREFAULT_BYTES:
        prefault(array.ctypes.data, size)
    return memoryview(array)


def prefault(address: int, size: int) -> bool:
    """Map the whole pages of [address, address + size) unless all are mapped already; True when it did."""
    global _CALLS
    if _CALLS is None:
        return False
    madvise, mincore = _CALLS
    start = -(-address // _PAGE) * _PAGE
    length = (address + size) // _PAGE * _PAGE - start
    if length <= 0:
        return False
    resident = (ctypes.c_ubyte * (length // _PAGE))()
    if mincore(start, length, resident) != 0:
        return False
    if b"\x00" not in bytes(resident):  # bit 0 of each byte: the page is mapped
        return False
    if madvise(start, length, MADV_POPULATE_WRITE) != 0:
        _CALLS = None  # an older kernel (EINVAL): stop asking
        return False
    return True


def resident_fraction(address: int, size: int) -> float:
    """Share of the whole pages of [address, address + size) that are mapped (for tests; 0.0 off Linux)."""
    if _CALLS is None:
        return 0.0
    _, mincore = _CALLS
    start = -(-address // _PAGE) * _PAGE
    length = (address + size) // _PAGE * _PAGE - start
    resident = (ctypes.c_ubyte * (length // _PAGE))()
    if length <= 0 or mincore(start, length, resident) != 0:
        return 0.0
    return 1.0 - bytes(resident).count(0) / (length // _PAGE)


__all__ = ["MADV_POPULATE_WRITE", "block_buffer", "prefault", "resident_fraction"]
