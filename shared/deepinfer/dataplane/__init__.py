"""The KV data plane: authenticated TCP frames that move KV block bytes between workers and the store.

NATS carries KvHandles; the bytes move here (docs/architecture.md §4). Torch-free: the engine's `kv_transfer`
turns paged KV tensors into the per-block payloads this package moves. See docs/dataplane.md.
"""

from deepinfer.dataplane.auth import MIN_SECRET_BYTES, generate_secret
from deepinfer.dataplane.client import DataPlaneClient, parse_address
from deepinfer.dataplane.errors import (
    BlockNotFound,
    ChecksumError,
    DataPlaneAuthError,
    DataPlaneConnectionError,
    DataPlaneError,
    DataPlaneTimeout,
    FrameError,
    FrameTooLarge,
    LeaseExpired,
)
from deepinfer.dataplane.frames import FrameHeader, FrameLimits, FrameOp
from deepinfer.dataplane.layout import LayoutMismatch, check_layout
from deepinfer.dataplane.metrics import DataPlaneMetrics
from deepinfer.dataplane.provider import BlockProvider
from deepinfer.dataplane.server import DataPlaneServer, ServerTimeouts

__all__ = [
    "MIN_SECRET_BYTES",
    "BlockNotFound",
    "BlockProvider",
    "ChecksumError",
    "DataPlaneAuthError",
    "DataPlaneClient",
    "DataPlaneConnectionError",
    "DataPlaneError",
    "DataPlaneMetrics",
    "DataPlaneServer",
    "DataPlaneTimeout",
    "FrameError",
    "FrameHeader",
    "FrameLimits",
    "FrameOp",
    "FrameTooLarge",
    "LayoutMismatch",
    "LeaseExpired",
    "ServerTimeouts",
    "check_layout",
    "generate_secret",
    "parse_address",
]
