"""The README's Python examples run as written (STYLE.md: examples are run by the tests, so they cannot rot)."""

from __future__ import annotations

import re
from pathlib import Path

import torch

README = Path(__file__).resolve().parents[2] / "README.md"


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_python_examples_run(capsys):
    blocks = python_blocks()
    assert blocks, "README has no python example"
    torch.set_num_threads(1)
    for block in blocks:
        exec(compile(block, str(README), "exec"), {"__name__": "readme"})
    assert "Paris" in capsys.readouterr().out
