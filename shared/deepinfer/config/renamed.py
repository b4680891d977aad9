"""Renamed settings: for one release an old env name still sets the new field, with a deprecation warning; a
removed setting's env name is only reported (it has no effect).

`RENAMED` maps an old field name to its new one. Every settings class that has the new field also reads its own
prefix + the old name (DEEPINFER_DECODE_<OLD>), below the new name: when both are set the new one wins. Only the
new names are described (`deepinfer config`, the docs); the chart's schema accepts the old keys for the same
release (scripts/chart_schema.py). Drop an entry one release after it was added.
"""

from __future__ import annotations

import logging
from typing import Any

from pydantic_settings import BaseSettings, EnvSettingsSource, SettingsError

log = logging.getLogger(__name__)

#: Old field name -> new field name (each accepted until the release after the one that renamed it).
RENAMED: dict[str, str] = {
    "gil_switch_interval_eager_step_s": "eager_step_switch_interval_s",  # issue 30: the engine's name
}

#: Old boolean field -> (the field that took its place, {old value: new value}), in the order they apply: one
#: value per new field, the first found wins. An old value missing from the map is the new field's default: its
#: env name is then only reported (issue 30: the execution-mode booleans became `execution_mode`, and the full
#: graphs' sampling tail became part of `graph_sampling`).
REPLACED: dict[str, tuple[str, dict[bool, Any]]] = {
    "piecewise_cuda_graphs": ("execution_mode", {False: "decode"}),
    "full_cuda_graphs": ("execution_mode", {False: "piecewise"}),
    "full_graph_sampling": ("graph_sampling", {}),
}


#: Removed field -> (a field still beside it in the settings class that had it, what replaced it): for one release
#: its env name is reported as having no effect, and the chart's schema still accepts its key.
REMOVED: dict[str, tuple[str, str]] = {  # issue 31: each worker's measured costs replaced the router's fixed weights
    "host_hit_weight": ("load_weight", "the router credits a cached prefix with the time it saves, from each "
                        "worker's measured load and prefill rates (docs/services.md)"),
    "store_hit_weight": ("load_weight", "the router credits a cached prefix with the time it saves, from each "
                         "worker's measured load and prefill rates (docs/services.md)"),
}


def removed_fields(cls: type[BaseSettings]) -> dict[str, str]:
    """The removed settings `cls` had: old field name -> what replaced it."""
    return {old: why for old, (beside, why) in REMOVED.items() if beside in cls.model_fields}


def renamed_fields(cls: type[BaseSettings]) -> dict[str, str]:
    """The renames that apply to `cls`: old field name -> new field name, for each new name `cls` has."""
    return {old: new for old, new in RENAMED.items() if new in cls.model_fields}


def deprecated_env_names(cls: type[BaseSettings]) -> dict[str, str]:
    """Old env name -> new env name of every rename that applies to `cls`."""
    prefix = str(cls.model_config.get("env_prefix", ""))
    return {f"{prefix}{old}".upper(): f"{prefix}{new}".upper() for old, new in renamed_fields(cls).items()}


def removed_env_names(cls: type[BaseSettings]) -> list[str]:
    """The env names of the removed settings `cls` had (read only to report them)."""
    prefix = str(cls.model_config.get("env_prefix", ""))
    return [f"{prefix}{old}".upper() for old in removed_fields(cls)]


class RenamedEnvSource(EnvSettingsSource):
    """Values under the old env names of renamed fields, keyed by the new names; logs each one found."""

    def __call__(self) -> dict[str, Any]:
        data: dict[str, Any] = {}
        prefix = str(self.settings_cls.model_config.get("env_prefix", ""))
        for old, new in renamed_fields(self.settings_cls).items():
            field = self.settings_cls.model_fields[new]
            value, _, is_complex = self.get_field_value(field, old)
            if value is None:
                continue
            old_env, new_env = f"{prefix}{old}".upper(), f"{prefix}{new}".upper()
            if self.get_field_value(field, new)[0] is not None:
                log.warning("%s is deprecated and ignored: %s is set", old_env, new_env)
                continue
            log.warning("%s is deprecated: use %s (the old name goes in the next release)", old_env, new_env)
            try:
                data[new] = self.prepare_field_value(new, field, value, is_complex)
            except ValueError as exc:
                raise SettingsError(f'error parsing value for field "{new}" from {old_env}') from exc
        self._report_removed(prefix)
        return data | self._replaced(prefix)

    def _report_removed(self, prefix: str) -> None:
        """Log each removed setting's env name that is set: it has no effect."""
        for old, why in removed_fields(self.settings_cls).items():
            env = f"{prefix}{old}".upper()
            raw = self.env_vars.get(env if self.case_sensitive else env.lower())
            if raw is not None:
                log.warning("%s=%s is deprecated and has no effect: %s", env, raw, why)

    def _replaced(self, prefix: str) -> dict[str, Any]:
        """Values the old boolean env names of REPLACED give their new fields (each one reported)."""
        data: dict[str, Any] = {}
        fields = self.settings_cls.model_fields
        for old, (new, values) in REPLACED.items():
            old_env, new_env = f"{prefix}{old}".upper(), f"{prefix}{new}".upper()
            raw = self.env_vars.get(old_env if self.case_sensitive else old_env.lower())
            if new not in fields or raw is None:
                continue
            flag = raw.strip().lower() in ("1", "true", "yes", "on")
            if new in data or self.get_field_value(fields[new], new)[0] is not None or flag not in values:
                log.warning("%s=%s is deprecated and has no effect (see %s)", old_env, raw, new_env)
                continue
            data[new] = values[flag]
            log.warning("%s=%s is deprecated: use %s=%s (the old name goes in the next release)", old_env, raw,
                        new_env, data[new])
        return data
