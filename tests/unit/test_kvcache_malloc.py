"""The kvcache shard tells glibc to keep freed block buffers: a full RAM tier receives new blocks into the memory of
the ones it evicted instead of faulting in fresh pages.

Each case runs in a fresh interpreter (mallopt changes the whole process), with no MALLOC_* variables set."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

SCRIPT = """
import collections, resource, sys
import numpy
if sys.argv[1] == "keep":
    from services.kvcache.malloc import keep_freed_buffers
    assert keep_freed_buffers()
ram = collections.deque()
def put(num_blocks, capacity):  # a put received into fresh buffers; a full RAM tier evicts its oldest blocks
    for _ in range(num_blocks):
        block = numpy.empty(2 << 20, dtype=numpy.uint8)
        block.fill(1)
        ram.append(block)
    while len(ram) > capacity:
        ram.popleft()
for _ in range(3):
    put(16, 32)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    put(16, 32)
print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 160)
"""


def _faults_per_block(mode: str) -> float:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join([os.path.join(root, "shared"), root])
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, mode], env=env, capture_output=True, text=True, timeout=60, check=True
    )
    return float(done.stdout.split()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_a_full_ram_tier_receives_into_the_memory_of_the_blocks_it_evicted():
    pages_per_block = (2 << 20) // os.sysconf("SC_PAGE_SIZE")
    assert _faults_per_block("keep") < 0.05 * pages_per_block
    # glibc's defaults hand much of it back and fault it in again (256 of 512 pages per block on the dev VM).
    assert _faults_per_block("default") > 0.25 * pages_per_block
