"""Evaluation parity: lm-evaluation-harness against a deepinfer endpoint."""
