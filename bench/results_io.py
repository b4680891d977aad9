"""A bench's result: one JSON line on stdout (the last a run prints) and, with --out, in a file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def emit_json_line(result: dict[str, Any], out: Path | None, append: bool = False) -> None:
    """Print `result` as one JSON line; with `out`, write it there too (append: add a line to the file)."""
    line = json.dumps(result)
    print(line)
    if out is None:
        return
    if append:
        with out.open("a") as file:
            file.write(line + "\n")
    else:
        out.write_text(line + "\n")
