"""Settings, built once at the edge from the environment and passed down (docs/architecture.md §9)."""

from deepinfer.config.common import DEFAULT_MODEL, CommonSettings, derive_served_model_name
from deepinfer.config.describe import SettingRow, describe_settings, to_camel
from deepinfer.config.loading import ALL_SETTINGS, env_name, load_settings
from deepinfer.config.services import (
    SERVICE_SETTINGS,
    DecodeSettings,
    GatewaySettings,
    KvCacheSettings,
    PrefillSettings,
    SchedulerSettings,
    ServiceSettings,
    WorkerSettings,
)

__all__ = [
    "ALL_SETTINGS",
    "DEFAULT_MODEL",
    "SERVICE_SETTINGS",
    "CommonSettings",
    "DecodeSettings",
    "GatewaySettings",
    "KvCacheSettings",
    "PrefillSettings",
    "SchedulerSettings",
    "ServiceSettings",
    "SettingRow",
    "WorkerSettings",
    "derive_served_model_name",
    "describe_settings",
    "env_name",
    "load_settings",
    "to_camel",
]
