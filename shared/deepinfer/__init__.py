"""DeepInfer: prefix-cache-first, disaggregated LLM serving.

`import deepinfer` stays light: torch users (`LLM`) load lazily on first attribute access.
"""

__version__ = "0.1.0"

__all__ = ["LLM", "SamplingParams", "__version__"]


def __getattr__(name: str):
    if name == "LLM":
        from deepinfer.engine.llm import LLM

        return LLM
    if name == "SamplingParams":
        from deepinfer.sampling.params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'deepinfer' has no attribute {name!r}")
