"""`make demo` (`python -m deepinfer.demo`): its own stack starts, answers one chat completion, stops, exit 0."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def test_the_demo_answers_then_stops_its_stack(tmp_path: Path):
    env = {**os.environ, "DEEPINFER_DATA_DIR": str(tmp_path / "data")}  # the default one may be locked by another stack
    done = subprocess.run([sys.executable, "-m", "deepinfer.demo"], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert lines[0] == "user: What is the capital of France?"
    assert lines[1].startswith("assistant: ") and "Paris" in lines[1], done.stdout
    assert "ready in" in done.stderr and "finish_reason=stop" in done.stderr
