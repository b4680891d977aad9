"""Probes of the service path: the serving sweep, its clients and hops, offline, traces, router, chaos, loop costs."""
