"""Engine defaults written once: `EngineArgs`, `EngineConfig`, the runner and `WorkerSettings` all read these
(vLLM's names and values)."""

#: Tokens per KV block (a power of two); block identity (hashes) depends on it.
DEFAULT_BLOCK_SIZE = 16
#: Most sequences in one batch.
DEFAULT_MAX_NUM_SEQS = 256
#: Most tokens computed in one step (decodes plus prefill chunks).
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048
