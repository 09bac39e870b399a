"""Workarounds for third-party libraries, each switched on explicitly and checked against the version it patches."""

from __future__ import annotations

import os

#: values of a ``DPFL_*`` environment switch that turn its workaround off
OFF_VALUES = ("off", "0", "false", "no")


def switched_off(name: str) -> bool:
    """Whether the environment switch ``name`` is set to one of :data:`OFF_VALUES` (unset: on)."""
    return os.environ.get(name, "on").strip().lower() in OFF_VALUES


def same_minor(version: object, patched: str) -> bool:
    """Whether ``version`` (a library's ``__version__``) has the major.minor ``patched`` a workaround was written for."""
    return ".".join(str(version).split(".")[:2]) == patched
