"""Receive buffers: uninitialised, writable, and on Linux their fresh pages mapped before the socket writes them."""

from __future__ import annotations

import sys

import pytest

from deepinfer.dataplane.buffers import MIN_PREFAULT_BYTES, block_buffer, prefault, resident_fraction


def test_a_block_buffer_is_a_writable_byte_view_of_the_size_asked():
    for size in (0, 1, 4096, MIN_PREFAULT_BYTES + 1):
        view = block_buffer(size)
        assert view.nbytes == size and view.format == "B" and not view.readonly
        view[:] = b"\x07" * size
        assert bytes(view) == b"\x07" * size


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mincore / MADV_POPULATE_WRITE are Linux's")
def test_fresh_pages_are_mapped_and_mapped_ones_are_left_alone():
    import mmap

    import numpy

    size = 8 << 20
    fresh = mmap.mmap(-1, size)  # anonymous memory never touched: no page mapped yet
    address = numpy.frombuffer(fresh, dtype=numpy.uint8).ctypes.data
    assert resident_fraction(address, size) == 0.0
    if not prefault(address, size):
        pytest.skip("this kernel has no MADV_POPULATE_WRITE (Linux < 5.14)")
    assert resident_fraction(address, size) == 1.0
    assert not prefault(address, size)  # every page is mapped now: nothing to do
    view = block_buffer(size)
    assert resident_fraction(numpy.frombuffer(view, dtype=numpy.uint8).ctypes.data, size) == 1.0
