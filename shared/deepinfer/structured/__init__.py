"""Structured output: JSON-schema and tool-call grammars (llguidance), their limits, and the per-request matcher.

Torch-free: the gateway compiles and checks grammars here; the workers build a `GrammarMatcher` per request and
read its token mask (the sampler applies it, `deepinfer.sampling.metadata`).
"""

from deepinfer.structured.grammar import GrammarError, GrammarMatcher, Grammars
from deepinfer.structured.schema import SchemaError, check_schema, json_object_grammar, json_schema_grammar

__all__ = [
    "GrammarError",
    "GrammarMatcher",
    "Grammars",
    "SchemaError",
    "check_schema",
    "json_object_grammar",
    "json_schema_grammar",
]
