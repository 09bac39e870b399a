"""One run-config key: its type, default, meaning and check, and how a raw value is coerced and checked.

:func:`setting` declares a key as a field of a section dataclass (:mod:`fedapp.config.sections`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from strategies.errors import ConfigError

T = TypeVar("T")

PRIVACY_DISTS = tuple(f"dist{i}" for i in range(1, 10)) + ("fixed",)
DATASETS = ("digits", "mnist", "fmnist", "cifar10", "cifar100", "a9a")
NODE_LOCAL = "node-local"  # run-config 'dataset': every SuperNode reads its own node-config 'data-path'
PARTITIONERS = ("iid", "shards", "pathological", "dirichlet")
MIN_ROUND_TIMEOUT_S = 1.0  # the shortest round-timeout accepted (0 = none)


@dataclass(frozen=True)
class Key:
    """One run-config key: its type, default, meaning and an optional check."""

    name: str
    type: type
    default: Any
    doc: str
    check: Callable[[Any], bool] | None = None
    expect: str = ""  # human-readable constraint used in error messages
    choices: tuple[str, ...] | None = None
    section: str = "general"
    prefix: str = ""  # values starting with it are accepted besides the choices (dataset = 'hf:...')
    attr: str = ""  # the RunConfig attribute of the section dataclass that holds this key


def _positive(v: Any) -> bool:
    return bool(v > 0)


def _nonneg(v: Any) -> bool:
    return bool(v >= 0)


def _unit_open(v: Any) -> bool:
    return bool(0 < v < 1)


def _fraction(v: Any) -> bool:
    return bool(0 <= v < 1)


def _prob(v: Any) -> bool:
    return bool(0 < v <= 1)


#: the metadata entry of a section field that holds its Key
KEY_METADATA = "run-config-key"


def setting(default: T, doc: str, *, check: Callable[[Any], bool] | None = None, expect: str = "",
            choices: tuple[str, ...] | None = None, prefix: str = "") -> T:
    """A section dataclass field declaring one run-config key (its name and type come from the field)."""
    spec = {"default": default, "doc": doc, "check": check, "expect": expect, "choices": choices, "prefix": prefix}
    return dataclasses.field(default=default, metadata={KEY_METADATA: spec})


def _coerce(key: Key, value: Any) -> Any:
    if key.type is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0"):
            return value.lower() in ("true", "1")
        raise ConfigError(f"run-config {key.name!r} expects true/false, got {value!r}")
    if key.type is int:
        if isinstance(value, bool):
            raise ConfigError(f"run-config {key.name!r} expects an integer, got {value!r}")
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                return int(value.strip())
            except ValueError:
                pass
        raise ConfigError(f"run-config {key.name!r} expects an integer, got {value!r}")
    if key.type is float:
        if isinstance(value, bool):
            raise ConfigError(f"run-config {key.name!r} expects a number, got {value!r}")
        try:
            out = float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"run-config {key.name!r} expects a number, got {value!r}") from None
        if not math.isfinite(out):
            raise ConfigError(f"run-config {key.name!r} must be finite, got {value!r}")
        return out
    if not isinstance(value, str):
        raise ConfigError(f"run-config {key.name!r} expects a string, got {value!r}")
    return value


def parse_input_shape(text: str) -> tuple[int, ...]:
    """Run-config ``input-shape``: ``"[1, 28, 28]"``, ``"1,28,28"`` or ``"16"`` → a tuple of positive ints (``()`` for
    ``""``). Flower's run-config holds no arrays, so the launchers pass ``input-shape=[16]`` on as the string
    ``"[16]"``."""
    raw = text.strip()
    if not raw:
        return ()
    inner = raw[1:-1] if raw.startswith("[") and raw.endswith("]") else raw
    try:
        dims = tuple(int(part) for part in inner.replace(" ", "").split(",") if part)
    except ValueError:
        dims = ()
    if not dims or any(d <= 0 for d in dims):
        raise ConfigError(f"run-config 'input-shape' = {text!r}: expected a list of positive integers, e.g. [16] or "
                          "[1, 28, 28]")
    return dims


def is_user_dataset(name: str) -> bool:
    """Whether run-config 'dataset' names a user's loader, ``module.path:loader`` (``hf:...`` is Hugging Face's)."""
    return not name.startswith("hf:") and ":" in name


def check_value(key: Key, value: Any) -> Any:
    value = _coerce(key, value)
    open_value = ((bool(key.prefix) and value.startswith(key.prefix) and len(value) > len(key.prefix))
                  or (key.name == "dataset" and is_user_dataset(value)))
    if key.choices is not None and value not in key.choices and not open_value:
        extra = f" or {key.prefix}..." if key.prefix else ""
        extra += " or module.path:loader" if key.name == "dataset" else ""
        raise ConfigError(f"run-config {key.name!r} = {value!r} is not one of {list(key.choices)}{extra}")
    if key.check is not None and not key.check(value):
        raise ConfigError(f"run-config {key.name!r} = {value!r} is invalid: must be {key.expect}")
    return value


def parse_int_list(name: str, text: str) -> list[int]:
    try:
        values = [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise ConfigError(f"run-config {name!r} = {text!r} must be comma-separated integers") from None
    if not values or any(v <= 0 for v in values):
        raise ConfigError(f"run-config {name!r} = {text!r} must list positive integers")
    return values


