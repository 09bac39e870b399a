"""Workarounds for third-party libraries, each switched on explicitly and checked against the version it patches."""
