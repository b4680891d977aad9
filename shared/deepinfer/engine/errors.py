"""Why the engine refuses a request, as types a caller can map without reading the message (torch-free)."""


class ContextLengthExceeded(ValueError):
    """The prompt (plus the tokens already generated) leaves no room to generate within max_model_len."""
