"""CPU engine bench: prefill and decode against transformers."""
