"""Build settings from the environment at a service's edge; a bad value exits 2 with one line."""

from __future__ import annotations

import sys
from typing import Any, NoReturn, TypeVar

from pydantic import ValidationError
from pydantic_settings import BaseSettings, SettingsError

from deepinfer.config.common import CommonSettings
from deepinfer.config.describe import ALL_SETTINGS, env_name, is_secret, setting_fields
from deepinfer.config.services import ServiceSettings

S = TypeVar("S", bound=BaseSettings)

#: Exit status for a configuration error (as argparse uses for usage errors).
EXIT_BAD_CONFIG = 2

__all__ = ["ALL_SETTINGS", "EXIT_BAD_CONFIG", "env_name", "format_validation_error", "load_settings"]


def load_settings(cls: type[S]) -> S:
    """Build `cls` (and its CommonSettings) from the environment, or print one line and exit 2."""
    if issubclass(cls, ServiceSettings):
        common = _build(CommonSettings)
        return _build(cls, common=common)
    return _build(cls)


def format_validation_error(cls: type[BaseSettings], exc: ValidationError) -> str:
    """One line naming the env variable, its value (masked if secret) and what is wrong."""
    errors = exc.errors()
    first = errors[0]
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    message = " ".join(str(first["msg"]).split())
    loc = first["loc"]
    fields = setting_fields(cls)
    if loc and loc[0] in fields:
        name = str(loc[0])
        shown = "***" if is_secret(fields[name]) else _short_repr(first.get("input"))
        return f"invalid setting {env_name(cls, name)}={shown}: {message}{more}"
    return f"invalid settings ({cls.__name__}): {message}{more}"


def _build(cls: type[S], **init: Any) -> S:
    try:
        return cls(**init)
    except ValidationError as exc:
        _fail(format_validation_error(cls, exc))
    except SettingsError as exc:  # an env value that should be JSON but is not
        _fail(f"invalid settings ({cls.__name__}): {' '.join(str(exc).split())}")


def _fail(line: str) -> NoReturn:
    print(f"deepinfer: {line}", file=sys.stderr)
    raise SystemExit(EXIT_BAD_CONFIG)


def _short_repr(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
