"""Logs: one JSON object per line with the request id; user text only when log_prompts is on."""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from datetime import UTC, datetime
from typing import IO, Any

from deepinfer.config import CommonSettings

#: Request id of the code running now; set with `request_context`, read by the formatters.
_request_id: ContextVar[str | None] = ContextVar("deepinfer_request_id", default=None)

#: `extra=` field names that may carry prompt or completion text; redacted unless log_prompts is on.
SENSITIVE_FIELDS = frozenset({"prompt", "completion", "prompt_text", "completion_text", "messages", "text"})

# Attributes every LogRecord has; anything else on a record came from `extra=`.
_RECORD_ATTRS = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime"}


@contextmanager
def request_context(request_id: str) -> Iterator[None]:
    """Tag every log line emitted inside the block (and in tasks it starts) with `request_id`."""
    token = _request_id.set(request_id)
    try:
        yield
    finally:
        _request_id.reset(token)


def current_request_id() -> str | None:
    """The request id set by the innermost `request_context`, if any."""
    return _request_id.get()


def redact(value: Any) -> str:
    """Stand-in for user text: its size, never its content."""
    return f"<redacted {len(str(value))} chars>"


def loggable_text(text: str, log_prompts: bool) -> str:
    """`text` itself when log_prompts is on, else a redacted stand-in."""
    return text if log_prompts else redact(text)


class PromptRedactionFilter(logging.Filter):
    """Replaces the SENSITIVE_FIELDS extras of a record unless log_prompts is on."""

    def __init__(self, log_prompts: bool) -> None:
        super().__init__()
        self.log_prompts = log_prompts

    def filter(self, record: logging.LogRecord) -> bool:
        """Redact in place; never drops a record."""
        if not self.log_prompts:
            for name in SENSITIVE_FIELDS.intersection(vars(record)):
                setattr(record, name, redact(getattr(record, name)))
        return True


def _extras(record: logging.LogRecord) -> dict[str, Any]:
    return {k: v for k, v in vars(record).items() if k not in _RECORD_ATTRS and not k.startswith("_")}


class JsonFormatter(logging.Formatter):
    """{"ts", "level", "logger", "msg", "request_id"?, ...extras, "exc"?} on one line."""

    def format(self, record: logging.LogRecord) -> str:
        """Render one record as a JSON object."""
        entry: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        request_id = getattr(record, "request_id", None) or _request_id.get()
        if request_id:
            entry["request_id"] = request_id
        entry.update(_extras(record))
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        if record.stack_info:
            entry["stack"] = self.formatStack(record.stack_info)
        return json.dumps(entry, default=str, ensure_ascii=False)


class TextFormatter(logging.Formatter):
    """`time level logger [request_id] msg key=value...` for humans."""

    def format(self, record: logging.LogRecord) -> str:
        """Render one record as a line (plus the traceback, if any)."""
        request_id = getattr(record, "request_id", None) or _request_id.get()
        parts = [self.formatTime(record), record.levelname, record.name]
        if request_id:
            parts.append(f"[{request_id}]")
        parts.append(record.getMessage())
        parts.extend(f"{k}={v}" for k, v in _extras(record).items() if k != "request_id")
        line = " ".join(parts)
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


def setup_logging(common: CommonSettings, stream: IO[str] | None = None) -> logging.Handler:
    """Route the root logger to `stream` (stderr) in the configured format and level; call once in main."""
    root = logging.getLogger()
    for handler in list(root.handlers):
        if getattr(handler, "_deepinfer", False):
            root.removeHandler(handler)
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(JsonFormatter() if common.log_format == "json" else TextFormatter())
    handler.addFilter(PromptRedactionFilter(common.log_prompts))
    handler._deepinfer = True  # type: ignore[attr-defined]  # marks the handler setup_logging owns
    root.addHandler(handler)
    root.setLevel(common.log_level.upper())
    return handler
