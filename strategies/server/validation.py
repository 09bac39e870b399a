"""One update validator for every strategy: what a client reply must satisfy before it touches the model.

Checks, in order (each failure raises :class:`RejectedUpdate` with the reason):

* metrics: ``client_id`` a non-negative integer, ``status`` a string, privacy fields finite and
  non-negative numbers (:func:`metric_problem`);
* ``num_examples`` > 0 and, where the server knows the client's dataset size, not above it;
* payload: the expected number of arrays, shapes and float dtypes (:meth:`UpdateValidator.decode_dense`);
* values: finite *after* the cast to the model dtype (float32: a finite float64 of 1e39 is not);
* norm: at most the mechanism's declared bound (clip C plus a noise allowance) where one exists; else
  (:meth:`UpdateValidator.norm_outliers`) at most ``robust_factor`` × the median of the norms accepted in earlier
  rounds (once any exist, whatever the round's size), × the median norm of the round's other updates (≥ 3
  arrived), and, in a round of two with no earlier norms, × the other update's norm (nobody is struck for that one).

:class:`StrikeRecord` remembers rejections across rounds; a client over the limit is excluded from
sampling and the run says so. Everything here is plain numpy; nothing a client sends can raise
anything but :class:`RejectedUpdate` out of it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from strategies.aggregate import flatten

#: privacy/diagnostic metric fields that must be finite, non-negative numbers when present
NUMERIC_METRICS = ("batch_size", "noise_multiplier", "sample_rate", "steps", "epsilon_budget", "epsilon_spent",
                   "delta", "reported_epsilon", "train_seconds")
FLOAT_DTYPES = ("float32", "float64")
MODEL_DTYPE = np.float32
#: how many of the latest accepted update norms the cross-round reference of :class:`UpdateValidator` keeps
NORM_HISTORY = 256


class RejectedUpdate(Exception):
    """A client result that must not touch the global model; the message is the reason."""


def short_repr(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def parse_client_id(value: Any) -> int | None:
    """The integer client id a reply claims, or None when it is not a non-negative integer."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, np.integer)) and int(value) >= 0:
        return int(value)
    if isinstance(value, float) and value.is_integer() and value >= 0:
        return int(value)
    return None


def number_metrics(metrics: Mapping[str, Any], *keys: str) -> tuple[int | float, ...] | None:
    """The values of ``keys``, unconverted, when every one is a number (an int or a float, never a bool);
    None when one is missing or of another type (a Flower ``Scalar`` may be bytes, str or bool)."""
    values: list[int | float] = []
    for key in keys:
        value = metrics.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return None
        values.append(value)
    return tuple(values)


def metric_problem(metrics: Mapping[str, Any]) -> str | None:
    """Why a client's metrics are malformed (``None`` when they are usable)."""
    if "client_id" not in metrics:
        return "metrics lack 'client_id'"
    if parse_client_id(metrics["client_id"]) is None:
        return f"malformed metric 'client_id' = {short_repr(metrics['client_id'])} (expected an integer >= 0)"
    if "status" in metrics and not isinstance(metrics["status"], str):
        return f"malformed metric 'status' = {short_repr(metrics['status'])} (expected a string)"
    for key in NUMERIC_METRICS:
        if key not in metrics:
            continue
        value = metrics[key]
        if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
            return f"malformed metric {key!r} = {short_repr(value)} (expected a number)"
        if not np.isfinite(float(value)):
            return f"malformed metric {key!r} = {value!r} (not finite)"
        if float(value) < 0:
            return f"malformed metric {key!r} = {value!r} (negative)"
    spent, budget = metrics.get("epsilon_spent"), metrics.get("epsilon_budget")
    if spent is not None and budget is not None and float(spent) > float(budget) * (1 + 1e-6):
        return f"epsilon_spent {float(spent):.6g} exceeds the client's epsilon_budget {float(budget):.6g}"
    return None


@dataclass(frozen=True)
class NormOutlier:
    """An update norm out of bounds: why, and whether its sender can be blamed (struck) for it."""

    reason: str
    attributable: bool = True


@dataclass
class UpdateValidator:
    """Validates decoded updates of one model (see the module docstring).

    ``norm_bound(dim)`` gives the mechanism's declared bound (None = none); ``robust_factor`` (0 = off)
    bounds mechanism-less updates by a multiple of a reference norm (:meth:`norm_outliers`); ``max_examples`` maps
    a client id to its known dataset size; ``norm_history`` holds the latest :data:`NORM_HISTORY` norms accepted
    in rounds where they were compared with another update (:meth:`remember`).
    """

    shapes: list[tuple[int, ...]]
    norm_bound: Callable[[int], float | None] = lambda dim: None
    robust_factor: float = 10.0
    max_examples: dict[int, int] = field(default_factory=dict)
    norm_history: deque[float] = field(default_factory=lambda: deque(maxlen=NORM_HISTORY))

    @property
    def num_params(self) -> int:
        return int(sum(int(np.prod(s)) if s else 1 for s in self.shapes))

    def check_examples(self, client_id: int, num_examples: int) -> None:
        if num_examples <= 0:
            raise RejectedUpdate(f"num_examples = {num_examples} (expected > 0)")
        known = self.max_examples.get(client_id)
        if known is not None and num_examples > known:
            raise RejectedUpdate(f"num_examples = {num_examples} exceeds client {client_id}'s dataset size {known}")

    def decode_dense(self, arrays: Sequence[np.ndarray]) -> np.ndarray:
        """Dense per-layer arrays of the model's shapes → one flat float64 vector."""
        if len(arrays) != len(self.shapes):
            raise RejectedUpdate(f"expected {len(self.shapes)} arrays, got {len(arrays)}")
        for i, (a, shape) in enumerate(zip(arrays, self.shapes)):
            if tuple(a.shape) != shape:
                raise RejectedUpdate(f"array {i} has shape {tuple(a.shape)}, expected {shape}")
            if a.dtype.name not in FLOAT_DTYPES:
                raise RejectedUpdate(f"array {i} has dtype {a.dtype}, expected one of {list(FLOAT_DTYPES)}")
        return flatten(arrays)

    def check_values(self, update: np.ndarray) -> float:
        """Shape, finiteness after the cast to the model dtype and the declared norm bound; returns the norm."""
        if update.shape != (self.num_params,):
            raise RejectedUpdate(f"update has {update.size} entries, the model has {self.num_params}")
        with np.errstate(over="ignore", invalid="ignore"):
            finite = np.all(np.isfinite(update)) and np.all(np.isfinite(update.astype(MODEL_DTYPE)))
            norm = float(np.linalg.norm(update)) if finite else float("inf")
        if not finite:
            raise RejectedUpdate("update contains NaN or Inf (or values beyond float32 range)")
        if not np.isfinite(norm):
            raise RejectedUpdate("update norm overflows")
        bound = self.norm_bound(update.size)
        if bound is not None and norm > bound * (1 + 1e-6):
            raise RejectedUpdate(f"update norm {norm:.6g} exceeds the declared bound {bound:.6g}")
        return norm

    @property
    def robust(self) -> bool:
        """Whether mechanism-less updates are screened by reference norms (a factor, and no declared bound)."""
        return self.robust_factor > 0 and self.norm_bound(self.num_params) is None

    def norm_outliers(self, norms: Sequence[float]) -> list[NormOutlier | None]:
        """Per update of a round: why its norm is out of bounds, or None. Only for mechanisms without a declared bound.

        With f = ``robust_factor``, an update is rejected when its norm exceeds

        * f × the median of :attr:`norm_history` (norms accepted in earlier rounds), once it holds any: a bound that
          does not depend on how many updates the round has;
        * f × the median of the round's *other* norms, with ≥ 3 updates (a median of others needs two; it
          excludes the update itself, so one huge update cannot raise it);
        * f × the other update's norm, in a round of exactly two and no history. Either update may be the hostile
          one (a tiny update makes an honest one look large), so this rejection is not attributable: nobody is
          struck for it.

        Each rule rests on honest updates being the majority of what it compares with.
        """
        out: list[NormOutlier | None] = [None] * len(norms)
        if not self.robust or not norms:
            return out
        f, values = self.robust_factor, np.asarray(norms, dtype=np.float64)
        past = float(np.median(np.asarray(self.norm_history))) if self.norm_history else None
        for i, n in enumerate(values):
            if past is not None and past > 0 and n > f * past:
                out[i] = NormOutlier(f"update norm {n:.6g} exceeds {f:g} x the median norm {past:.6g} of the updates "
                                     "accepted in earlier rounds")
            elif len(values) >= 3 and (others := float(np.median(np.delete(values, i)))) > 0 and n > f * others:
                out[i] = NormOutlier(f"update norm {n:.6g} exceeds {f:g} x the median norm {others:.6g} of the "
                                     "round's other updates")
        if len(values) == 2 and past is None:
            small, large = (0, 1) if values[0] <= values[1] else (1, 0)
            if values[small] > 0 and values[large] > f * values[small]:
                out[large] = NormOutlier(
                    f"update norm {values[large]:.6g} exceeds {f:g} x the norm {values[small]:.6g} of the round's "
                    "other update, with no earlier norms to compare with: either may be the hostile one, nobody is "
                    "struck", attributable=False)
        return out

    def robust_outliers(self, norms: Sequence[float]) -> list[str | None]:
        """The reasons of :meth:`norm_outliers` (None for an update within bounds)."""
        return [o.reason if o is not None else None for o in self.norm_outliers(norms)]

    def remember(self, accepted: Sequence[float], unattributed: bool) -> None:
        """Add a round's accepted norms to :attr:`norm_history` when they were compared with each other: at least
        two, and no rejection of the round was unattributable (then the smaller may be the hostile one). A lone
        update never enters it, so a node alone in its rounds cannot drag the reference down."""
        if self.robust and len(accepted) >= 2 and not unattributed:
            self.norm_history.extend(float(n) for n in accepted)

    def state(self) -> dict[str, Any]:
        return {"norm_history": [float(n) for n in self.norm_history]}

    def load(self, state: Mapping[str, Any]) -> None:
        self.norm_history.clear()
        self.norm_history.extend(float(n) for n in state.get("norm_history", []))


@dataclass
class StrikeRecord:
    """Rejections per client across rounds; a client with ``limit`` strikes is excluded (0 = never)."""

    limit: int = 3
    strikes: dict[int, int] = field(default_factory=dict)
    reasons: dict[int, str] = field(default_factory=dict)

    def add(self, client_id: int | None, reason: str) -> bool:
        """Record a strike; True when this strike excludes the client."""
        if client_id is None:
            return False
        self.strikes[client_id] = self.strikes.get(client_id, 0) + 1
        self.reasons[client_id] = reason
        return self.limit > 0 and self.strikes[client_id] == self.limit

    def excluded(self, client_id: int | None) -> bool:
        return client_id is not None and self.limit > 0 and self.strikes.get(client_id, 0) >= self.limit

    def state(self) -> dict[str, Any]:
        return {"strikes": {str(k): v for k, v in self.strikes.items()},
                "reasons": {str(k): v for k, v in self.reasons.items()}}

    def load(self, state: Mapping[str, Any]) -> None:
        self.strikes = {int(k): int(v) for k, v in dict(state.get("strikes", {})).items()}
        self.reasons = {int(k): str(v) for k, v in dict(state.get("reasons", {})).items()}
