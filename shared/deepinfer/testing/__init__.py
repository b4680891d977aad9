"""Test doubles for unit tests (ARCHITECTURE: small interfaces with a fake beside them)."""

from deepinfer.testing.fake_bus import FakeBroker, FakeBus, FakeMsg, FakeSubscription, subject_matches

__all__ = ["FakeBroker", "FakeBus", "FakeMsg", "FakeSubscription", "subject_matches"]
