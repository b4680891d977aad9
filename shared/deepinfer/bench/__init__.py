"""Benchmark tooling users run (`deepinfer bench ...`): today the comparison of two result files."""
