"""`deepinfer.testing.checkpoints` for the GPU tests, loaded by path: the package's __init__ imports the bus
(nats-py), which the GPU image does not have."""

import importlib.util
from pathlib import Path

_spec = importlib.util.spec_from_file_location(
    "checkpoints", Path(__file__).resolve().parents[2] / "shared/deepinfer/testing/checkpoints.py"
)
checkpoints = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(checkpoints)
