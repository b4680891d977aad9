"""Developer probes: one topic per folder (gpu, kv, gateway, serve, cpu, spec, eval), each with a README.

Run from the repository root with `PYTHONPATH=shared:.`, e.g. `python -m bench.gpu.gpu --help`."""
