"""Gateway: the OpenAI/Anthropic-compatible HTTP front door; owns each request's life."""
