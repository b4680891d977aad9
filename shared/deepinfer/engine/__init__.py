"""The engine shared by prefill and decode workers: scheduler, block pool and KV manager (torch-free), runner."""
