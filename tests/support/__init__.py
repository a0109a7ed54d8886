"""Helpers for tests that run real parts: a Redis server of their own, service processes, free ports."""
