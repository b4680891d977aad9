"""Settings every service shares, under the `DEEPINFER_` env prefix."""

from __future__ import annotations

import os
import re
import socket
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from deepinfer import subjects
from deepinfer.config.renamed import RenamedEnvSource
from deepinfer.defaults import DEFAULT_ACCELERATOR, DEFAULT_MODEL, default_model_cache_dir, xdg_dir


def settings_config(env_prefix: str) -> SettingsConfigDict:
    """The model_config every settings class uses: env only (no .env file), frozen once built."""
    return SettingsConfigDict(
        env_prefix=env_prefix,
        case_sensitive=False,
        env_ignore_empty=True,  # FOO= means "unset", not "empty string"
        extra="forbid",  # a misspelt keyword fails; unknown env variables are never read
        frozen=True,
        validate_default=True,
    )


def default_data_dir() -> Path:
    """~/.local/share/deepinfer (XDG_DATA_HOME respected)."""
    return xdg_dir("XDG_DATA_HOME", ".local/share", "deepinfer")


def default_id(role: str) -> str:
    """A unique-ish, subject-safe id: `<role>-<short hostname>-<pid>`."""
    host = socket.gethostname().split(".", 1)[0].lower()
    host = re.sub(r"[^a-z0-9_-]", "-", host) or "host"
    return f"{role}-{host}-{os.getpid()}"


def derive_served_model_name(model: str) -> str:
    """The name clients use for `model`: a local path serves under its last component, anything else as is."""
    if model.startswith(("/", "./", "../", "~")):
        return Path(model).expanduser().name or model
    return model


class EnvSettings(BaseSettings):
    """Base of every settings class. Sources, first wins: init arguments, the env names, then the old env names of
    renamed settings (deprecated: deepinfer.config.renamed)."""

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        """Init arguments, env, then renamed settings' old env names (no .env file, no secrets directory)."""
        return init_settings, env_settings, RenamedEnvSource(settings_cls)


class CommonSettings(EnvSettings):
    """Settings shared by every service (env prefix DEEPINFER_)."""

    model_config = settings_config("DEEPINFER_")

    nats_url: str = Field("nats://127.0.0.1:4222", description="NATS server URL(s), comma-separated.")
    nats_token: SecretStr | None = Field(None, description="NATS auth token.")
    nats_user: str | None = Field(None, description="NATS user name (with nats_password).")
    nats_password: SecretStr | None = Field(None, description="NATS password.")
    nats_tls_ca: Path | None = Field(None, description="CA bundle to verify the NATS server's certificate.")
    nats_tls_cert: Path | None = Field(None, description="Client certificate for NATS mutual TLS.")
    nats_tls_key: Path | None = Field(None, description="Client key for NATS mutual TLS.")
    model: str = Field(DEFAULT_MODEL, description="Model to serve: a registry alias, a hub id or a local path.")
    served_model_name: str | None = Field(
        None, description="Name clients use in requests; unset = derived from model (a path's last component)."
    )
    model_revision: str | None = Field(
        None, description="Pins the model fingerprint (otherwise computed from the weights' content)."
    )
    accelerator: Literal["auto", "cuda", "ascend", "cpu"] = Field(
        DEFAULT_ACCELERATOR, description="Kernel backend: cuda (Triton), ascend (torch_npu), cpu (torch twins)."
    )
    log_level: Literal["debug", "info", "warning", "error", "critical"] = Field("info", description="Log level.")
    log_format: Literal["json", "text"] = Field("json", description="json: one object per line; text: for humans.")
    log_prompts: bool = Field(
        False, description="Allow prompt and completion text in logs (debug only; off = never logged)."
    )
    otel_exporter: Literal["none", "console", "otlp", "file"] = Field(
        "none",
        description="Trace exporter: none (spans not recorded), console, otlp (needs opentelemetry-exporter-otlp), "
        "file (JSON lines per process in otel_file_dir).",
    )
    otel_file_dir: Path | None = Field(
        None, description="Directory of the file exporter's <service>-<pid>.jsonl; unset = <data_dir>/traces."
    )
    otel_endpoint: str | None = Field(None, description="OTLP endpoint, e.g. http://collector:4317.")
    otel_token_spans: Literal["first_last", "all"] = Field(
        "first_last",
        description="Which token batches (decode) and SSE writes (gateway) of a traced request become spans: "
        "first_last (the first, TTFT-critical, and the last, which ends the stream) or all (every one: debugging, "
        "costs a span per step per request). Their hop histograms observe every one either way.",
    )
    internal_host: str = Field(
        "127.0.0.1", description="Interface of the internal /health /ready /metrics server (0.0.0.0 in a pod)."
    )
    data_plane_secret: SecretStr | None = Field(
        None, description="Shared secret of the KV data-plane handshake."
    )
    model_cache_dir: Path = Field(
        default_factory=default_model_cache_dir, description="Where model files are cached (XDG cache dir)."
    )
    data_dir: Path = Field(
        default_factory=default_data_dir, description="Where durable data (kvcache disk tier) lives (XDG data dir)."
    )

    @field_validator("log_level", "log_format", "accelerator", "otel_exporter", "otel_token_spans", mode="before")
    @classmethod
    def _lowercase(cls, value: Any) -> Any:
        return value.lower() if isinstance(value, str) else value

    @field_validator("nats_tls_ca", "nats_tls_cert", "nats_tls_key", "model_cache_dir", "data_dir", "otel_file_dir")
    @classmethod
    def _expand_user(cls, value: Path | None) -> Path | None:
        return value.expanduser() if value is not None else None

    @model_validator(mode="before")
    @classmethod
    def _derive_served_model_name(cls, data: Any) -> Any:
        if isinstance(data, dict) and not data.get("served_model_name"):
            model = data.get("model") or DEFAULT_MODEL
            data = {**data, "served_model_name": derive_served_model_name(str(model))}
        return data

    @field_validator("served_model_name")
    @classmethod
    def _subject_safe_name(cls, value: str | None) -> str | None:
        if value is not None:
            subjects.model_token(value)  # raises ValueError on an empty or reserved name
        return value

    @property
    def model_token(self) -> str:
        """The served model name as it appears in NATS subjects."""
        return subjects.model_token(self.served_model_name or derive_served_model_name(self.model))
