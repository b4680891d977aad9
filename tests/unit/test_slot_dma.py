"""deepinfer.engine.slot_dma on the CPU: which leased slots go to the device as one copy (runs of adjacent whole
slots into adjacent rows), and a registrar that refuses what is not a region's slot array. The copies themselves:
tests/gpu/test_store_shm_dma_gpu.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from deepinfer.engine.slot_dma import CudaRegistrar, _runs


def test_adjacent_whole_slots_into_adjacent_rows_are_one_copy():
    positions, slots = [0, 1, 2, 3, 7, 8], [5, 6, 7, 0, 2, 3]
    assert _runs(positions, slots, merge=True) == [(0, 5, 3), (3, 0, 1), (7, 2, 2)]
    assert _runs(positions, slots, merge=False) == [(p, s, 1) for p, s in zip(positions, slots, strict=True)]
    assert _runs([], [], merge=True) == []


def test_the_registrar_takes_only_a_two_dimensional_uint8_slot_array():
    registrar = CudaRegistrar(torch.device("cuda"))
    for bad in (
        np.zeros((4, 4096), np.int32),
        np.zeros(4096, np.uint8),
        np.zeros((4, 4096), np.uint8)[:, ::2],
        np.zeros((0, 4096), np.uint8),
    ):
        with pytest.raises(ValueError):
            registrar.register(bad)
