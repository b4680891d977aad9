"""Integration-tier fixtures."""

from tests.cpu_dtype import float32_on_every_cpu  # noqa: F401  (an autouse fixture)
