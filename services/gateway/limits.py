"""Per-key rate limits: requests per minute and tokens per minute, as token buckets; OpenAI's x-ratelimit-* headers.

    limits = RateLimits(requests_per_minute=60, tokens_per_minute=100_000)
    limits.check_requests(tenant)              # cheap pre-check before the body is read: 429 when no request is left
    headers = limits.admit(tenant, tokens)     # takes one request and `tokens` (prompt + max_tokens), or 429

A bucket holds up to a minute's allowance and refills continuously (limit / 60 per second), so a key may burst a
minute's worth at once and then runs at its rate. Tokens are counted when a request is admitted, the prompt plus
its `max_tokens` (the rest of the context when unset), as OpenAI counts them; nothing is refunded.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from deepinfer.protocol import ErrorCode
from services.gateway.errors import ApiError


@dataclass
class Bucket:
    """One allowance: `limit` per minute, refilled continuously."""

    limit: int
    level: float
    updated_s: float

    @property
    def rate_per_s(self) -> float:
        """Refill rate."""
        return self.limit / 60.0

    def refill(self, now_s: float) -> None:
        """Add what accrued since the last update, up to the limit."""
        self.level = min(float(self.limit), self.level + (now_s - self.updated_s) * self.rate_per_s)
        self.updated_s = now_s

    def wait_s(self, cost: float) -> float:
        """Seconds until `cost` is available (0 when it is now)."""
        return max(0.0, (cost - self.level) / self.rate_per_s)

    def reset_s(self) -> float:
        """Seconds until the bucket is full again."""
        return (self.limit - self.level) / self.rate_per_s


@dataclass
class TenantBuckets:
    """One key's buckets (None: that limit is off)."""

    requests: Bucket | None
    tokens: Bucket | None
    buckets: tuple[tuple[str, Bucket], ...] = field(init=False)

    def __post_init__(self) -> None:
        named = (("requests", self.requests), ("tokens", self.tokens))
        self.buckets = tuple((name, bucket) for name, bucket in named if bucket is not None)


def format_reset(seconds: float) -> str:
    """A duration as OpenAI writes x-ratelimit-reset-*: "120ms", "6s", "1m30s"."""
    if seconds < 1.0:
        return f"{math.ceil(seconds * 1000)}ms"
    whole = math.ceil(seconds)
    minutes, secs = divmod(whole, 60)
    return f"{minutes}m{secs}s" if minutes else f"{secs}s"


def rate_limited(kind: str, message: str, retry_after_s: float | None, headers: dict[str, str]) -> ApiError:
    """429 in OpenAI's shape: type "requests" or "tokens", code rate_limit_exceeded."""
    return ApiError(ErrorCode.RATE_LIMITED, message, error_type=kind, retry_after_s=retry_after_s, headers=headers)


class RateLimits:
    """Every key's buckets (keys are few: the configured ones, or "" without auth)."""

    def __init__(
        self,
        requests_per_minute: int | None,
        tokens_per_minute: int | None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.requests_per_minute = requests_per_minute
        self.tokens_per_minute = tokens_per_minute
        self.clock = clock
        self.tenants: dict[str, TenantBuckets] = {}

    def __bool__(self) -> bool:
        return self.requests_per_minute is not None or self.tokens_per_minute is not None

    def _buckets(self, tenant: str) -> TenantBuckets:
        now_s = self.clock()
        found = self.tenants.get(tenant)
        if found is None:
            def full(limit: int | None) -> Bucket | None:
                return None if limit is None else Bucket(limit, float(limit), now_s)

            found = self.tenants[tenant] = TenantBuckets(full(self.requests_per_minute), full(self.tokens_per_minute))
        for _, bucket in found.buckets:
            bucket.refill(now_s)
        return found

    def headers(self, tenant: str) -> dict[str, str]:
        """x-ratelimit-{limit,remaining,reset}-{requests,tokens} as they stand now."""
        headers = {}
        for name, bucket in self._buckets(tenant).buckets:
            headers[f"x-ratelimit-limit-{name}"] = str(bucket.limit)
            headers[f"x-ratelimit-remaining-{name}"] = str(math.floor(bucket.level))
            headers[f"x-ratelimit-reset-{name}"] = format_reset(bucket.reset_s())
        return headers

    def check_requests(self, tenant: str) -> None:
        """429 when the key has no request left now (nothing is taken)."""
        buckets = self._buckets(tenant)
        if buckets.requests is not None and buckets.requests.level < 1.0:
            raise self._refusal(tenant, "requests", buckets.requests, 1)

    def admit(self, tenant: str, tokens: int) -> dict[str, str]:
        """Take one request and `tokens` from the key's buckets, or 429 (taking nothing); the headers after."""
        buckets = self._buckets(tenant)
        costs = {"requests": 1, "tokens": tokens}
        for name, bucket in buckets.buckets:
            if costs[name] > bucket.limit:
                raise rate_limited(
                    name, f"Request too large: {costs[name]} {name} asked, over the limit of {bucket.limit} {name} "
                    "per minute; lower max_tokens or the prompt", None, self.headers(tenant),
                )
            if bucket.level < costs[name]:
                raise self._refusal(tenant, name, bucket, costs[name])
        for name, bucket in buckets.buckets:
            bucket.level -= costs[name]
        return self.headers(tenant)

    def _refusal(self, tenant: str, name: str, bucket: Bucket, cost: int) -> ApiError:
        wait_s = bucket.wait_s(cost)
        return rate_limited(
            name, f"Rate limit reached for {name} per minute: limit {bucket.limit}, remaining "
            f"{math.floor(bucket.level)}, requested {cost}. Please try again in {format_reset(wait_s)}.",
            wait_s, self.headers(tenant),
        )
