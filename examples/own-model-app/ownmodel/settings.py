"""ownmodel: the DP-SGD settings server and clients must share, read from the run-config in one place."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fedapp.library import DPSGDSettings


def dpsgd_settings(cfg: Mapping[str, Any]) -> DPSGDSettings:
    """Rounds of the ε budget, per-sample clip and learning rate: the clients train with them, the server checks
    every update against them."""
    return DPSGDSettings(rounds=int(cfg["num-server-rounds"]), clip_norm=float(cfg["clip-norm"]), lr=float(cfg["lr"]),
                         local_epochs=int(cfg["local-epochs"]))
