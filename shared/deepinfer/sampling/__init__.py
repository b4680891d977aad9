"""Sampling: `SamplingParams` (plain Python) and the torch sampler, loaded lazily so this import stays torch-free."""

from deepinfer.sampling.params import SamplingParams

__all__ = ["Sampler", "SamplerOutput", "SamplingMetadata", "SamplingParams", "apply_sampling_filters"]


def __getattr__(name: str):
    if name in ("Sampler", "SamplerOutput", "apply_sampling_filters"):
        from deepinfer.sampling import sampler

        return getattr(sampler, name)
    if name == "SamplingMetadata":
        from deepinfer.sampling.metadata import SamplingMetadata

        return SamplingMetadata
    raise AttributeError(f"module 'deepinfer.sampling' has no attribute {name!r}")
