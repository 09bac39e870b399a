"""Errors shared by the library and the Flower glue (framework-free)."""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration value (run-config, node-config, constructor argument) is invalid; the message names it."""
