"""Field types shared by several messages: block hashes and ids."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

#: Size of a block hash: SHA-256 truncated to 16 bytes (docs/architecture.md §4).
BLOCK_HASH_BYTES = 16

#: A content hash of one full KV block, raw bytes on the wire (msgpack bin), never hex.
BlockHash = Annotated[bytes, Field(min_length=BLOCK_HASH_BYTES, max_length=BLOCK_HASH_BYTES)]

#: A token count or an index: never negative.
NonNegativeInt = Annotated[int, Field(ge=0)]

#: A size or a limit that cannot be zero (block_size, max_num_seqs).
PositiveInt = Annotated[int, Field(ge=1)]

#: A rate that cannot be zero (bytes or tokens per second).
PositiveFloat = Annotated[float, Field(gt=0)]
