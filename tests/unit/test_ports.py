"""Free ports come from below the ephemeral range (never an outgoing connection's local port), once each."""

from __future__ import annotations

import socket

from deepinfer import ports


def test_ports_come_from_below_the_ephemeral_range_and_are_handed_out_once(tmp_path, monkeypatch):
    range_file = tmp_path / "ip_local_port_range"
    range_file.write_text("40000\t60999\n")
    monkeypatch.setattr(ports, "_EPHEMERAL_RANGE", range_file)
    assert ports.listen_range() == (30000, 40000)
    drawn = [ports.free_port() for _ in range(50)]
    assert len(set(drawn)) == 50 and all(30000 <= port < 40000 for port in drawn)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", drawn[-1]))  # free right after


def test_a_taken_range_falls_back_to_the_os(tmp_path, monkeypatch):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        taken = listener.getsockname()[1]
        range_file = tmp_path / "ip_local_port_range"
        range_file.write_text(f"{taken + 1} 65000\n")
        monkeypatch.setattr(ports, "_EPHEMERAL_RANGE", range_file)
        monkeypatch.setattr(ports, "LISTEN_SPAN", 1)
        assert ports.listen_range() == (taken, taken + 1)
        port = ports.free_port()
        assert port != taken and port > 0


def test_without_the_proc_file_a_default_span_is_used(tmp_path, monkeypatch):
    monkeypatch.setattr(ports, "_EPHEMERAL_RANGE", tmp_path / "missing")
    assert ports.listen_range() == ports._DEFAULT_RANGE
