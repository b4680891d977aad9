"""Benchmark tooling users run (`deepinfer bench`): load sweeps against any OpenAI-compatible server (concurrency,
Poisson rate, Mooncake trace replay, multi-turn conversations), their JSON, CSV, cost table and plots, and the
comparison of two results. The guide is docs/bench.md."""
