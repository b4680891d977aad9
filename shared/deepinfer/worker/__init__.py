"""What prefill and decode workers share: the engine thread, settings → engine args, heartbeats, KV events."""
