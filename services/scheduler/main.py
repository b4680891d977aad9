"""Composition root of the scheduler: settings → runtime (bus, telemetry, signals) → handler."""

from __future__ import annotations

from deepinfer.config import SchedulerSettings
from deepinfer.service import ServiceContext, service_main
from services.scheduler.handler import SchedulerHandler, build_handler


async def build(ctx: ServiceContext[SchedulerSettings]) -> SchedulerHandler:
    """The scheduler's handler on the runtime's bus and registry."""
    return build_handler(ctx.settings, ctx.bus, ctx.registry, tracer=ctx.tracer)


def main() -> int:
    """`python -m services.scheduler` / `deepinfer serve scheduler`: run until SIGTERM; the exit code."""
    return service_main(SchedulerSettings, build)
