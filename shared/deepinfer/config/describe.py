"""Every setting of every class as rows (env name, type, default, description), generated from the classes."""

from __future__ import annotations

import types
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from enum import Enum
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import ByteSize, SecretStr
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings

from deepinfer.config.common import CommonSettings
from deepinfer.config.services import SERVICE_SETTINGS, ServiceSettings

#: Every settings class, common first, in the order they are described.
ALL_SETTINGS: tuple[type[BaseSettings], ...] = (CommonSettings, *SERVICE_SETTINGS.values())

#: Fields that hold other settings objects rather than one value.
_NESTED_FIELDS = frozenset({"common"})


@dataclass(frozen=True)
class SettingRow:
    """One setting: where it comes from, what it takes, what it defaults to."""

    group: str  # "common" or the service name
    env: str
    field: str
    helm_key: str
    type: str
    default: str
    description: str
    secret: bool
    value: str | None = None  # current value, when described from loaded settings

    def to_dict(self) -> dict[str, Any]:
        """Plain dict for JSON output."""
        return asdict(self)


def to_camel(field_name: str) -> str:
    """Helm values key of a field: gpu_memory_utilization -> gpuMemoryUtilization."""
    head, *rest = field_name.split("_")
    return head + "".join(part[:1].upper() + part[1:] for part in rest)


def env_name(cls: type[BaseSettings], field_name: str) -> str:
    """The environment variable that sets `field_name` of `cls`, e.g. DEEPINFER_GATEWAY_PORT."""
    return f"{cls.model_config.get('env_prefix', '')}{field_name}".upper()


def group_of(cls: type[BaseSettings]) -> str:
    """'common' or the service name of a settings class."""
    return cls.service if issubclass(cls, ServiceSettings) else "common"


def setting_fields(cls: type[BaseSettings]) -> dict[str, FieldInfo]:
    """The fields of `cls` that are single settings (the nested `common` excluded)."""
    return {name: info for name, info in cls.model_fields.items() if name not in _NESTED_FIELDS}


def is_secret(info: FieldInfo) -> bool:
    """True for fields whose values must never be printed."""
    extra = info.json_schema_extra if isinstance(info.json_schema_extra, dict) else {}
    return bool(extra.get("secret")) or SecretStr in _flatten(info.annotation)


def type_name(annotation: Any) -> str:
    """A short human name of a field's type: `int | None`, `auto|cuda|cpu`, `size`, `path`."""
    origin = get_origin(annotation)
    args = get_args(annotation)
    if origin is Annotated:
        return type_name(args[0])
    if origin in (Union, types.UnionType):
        present = [a for a in args if a is not type(None)]
        text = " | ".join(type_name(a) for a in present)
        return f"{text} | None" if len(present) < len(args) else text
    if origin is Literal:
        return "|".join(str(a) for a in args)
    if origin is list:
        return f"list[{type_name(args[0])}]"
    if annotation is ByteSize:
        return "size"
    if annotation is SecretStr:
        return "secret"
    if isinstance(annotation, type) and issubclass(annotation, Path):
        return "path"
    return getattr(annotation, "__name__", str(annotation))


def render_value(value: Any, secret: bool) -> str:
    """How a value is shown: secrets as *** (or unset), sizes human-readable, bools lowercase."""
    if value is None or (secret and not value):
        return "unset"
    if secret:
        return "***"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, ByteSize):
        return value.human_readable()
    if isinstance(value, Enum):
        return str(value.value)
    if isinstance(value, list):
        return ",".join(str(item) for item in value) if value else "[]"
    return str(value)


def describe_settings(loaded: Iterable[BaseSettings] = ()) -> list[SettingRow]:
    """Rows for every field of every settings class; with `loaded` instances, their current values too."""
    current = _current_instances(loaded)
    rows = []
    for cls in ALL_SETTINGS:
        instance = current.get(cls)
        for name, info in setting_fields(cls).items():
            secret = is_secret(info)
            rows.append(
                SettingRow(
                    group=group_of(cls),
                    env=env_name(cls, name),
                    field=name,
                    helm_key=to_camel(name),
                    type=type_name(info.annotation),
                    default=render_value(info.get_default(call_default_factory=True), secret),
                    description=info.description or "",
                    secret=secret,
                    value=None if instance is None else render_value(getattr(instance, name), secret),
                )
            )
    return rows


def _current_instances(loaded: Iterable[BaseSettings]) -> dict[type, BaseSettings]:
    current: dict[type, BaseSettings] = {}
    for settings in loaded:
        current[type(settings)] = settings
        if isinstance(settings, ServiceSettings):
            current.setdefault(CommonSettings, settings.common)
    return current


def _flatten(annotation: Any) -> set[Any]:
    args = get_args(annotation)
    if not args:
        return {annotation}
    return {leaf for arg in args for leaf in _flatten(arg)}
