"""What a client-level DP client checks itself instead of taking the server's word.

The run-config and each round's fit config come from the server. The numbers there that could lower a client's
noise, raise what it may spend or set its clip, the client bounds or checks with its own:

* ``r_t`` (``dp-round-clients``): each client adds N(0, C²σ²/r_t) so the sum of r_t updates carries σC; a
  server claiming a larger r_t cuts everyone's noise. node-config ``min-round-clients`` caps the r_t a client
  uses (it then adds noise for at most that many survivors).
* σ: node-config ``min-noise-multiplier`` is the smallest σ this client trains with; a run below it is refused.
* C_t (``dp-clip-norm``, adaptive clipping): the clip is the server's, but the multiplier z_Δ the client noises
  with is derived from its own run-config (``fedapp.clients.client_dp.adaptive_round``), so a C_t changes no
  update's multiplier; a missing, non-finite or non-positive C_t is refused.
* the round number: the client counts its own releases in ``Context.state`` and charges its budget for
  max(server round, its releases), so a server that repeats or understates rounds cannot make it spend more.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from flwr.common import Context

from fedapp.clients.common import read_record, write_record
from fedapp.config import ConfigError
from strategies.client_level import CFG_ROUND_CLIENTS
from strategies.privacy.mechanisms import ClientLevelDP

PARTICIPATIONS = "client-level-releases"  # Context.state record: how many updates this client released


@dataclass(frozen=True)
class ClientFloors:
    """The client's own bounds on what the server says (node-config; 0 = none)."""

    min_round_clients: int = 0
    min_noise_multiplier: float = 0.0

    @classmethod
    def from_node_config(cls, node_config: Mapping[str, Any]) -> ClientFloors:
        try:
            r_min = int(node_config.get("min-round-clients", 0))
            z_min = float(node_config.get("min-noise-multiplier", 0.0))
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"node-config 'min-round-clients' / 'min-noise-multiplier' must be numbers: {exc}") from None
        if r_min < 0 or not z_min >= 0:
            raise ConfigError(f"node-config 'min-round-clients' = {r_min} and 'min-noise-multiplier' = {z_min} must be "
                              ">= 0")
        return cls(r_min, z_min)


def round_clients(config: Mapping[str, Any], dp: ClientLevelDP, floors: ClientFloors | None = None) -> int:
    """r_t this client adds noise for: the server's count clamped to 1..n and to ``min-round-clients``."""
    r = min(max(int(config.get(CFG_ROUND_CLIENTS, dp.clients_per_round)), 1), dp.num_clients)
    if floors is not None and floors.min_round_clients > 0:
        r = min(r, floors.min_round_clients)
    return r


def floor_refusal(dp: ClientLevelDP, floors: ClientFloors) -> str | None:
    """Why this client does not train with ``dp`` (None when it may)."""
    if floors.min_noise_multiplier > 0 and dp.noise_multiplier < floors.min_noise_multiplier:
        return (f"noise multiplier {dp.noise_multiplier:.6g} is below this client's node-config "
                f"'min-noise-multiplier' = {floors.min_noise_multiplier:g}")
    return None


def releases(context: Context | None) -> int:
    """Updates this client released so far in this run."""
    return int(read_record(context, PARTICIPATIONS).get("count", 0)) if context is not None else 0


def record_release(context: Context | None) -> None:
    if context is not None:
        write_record(context, PARTICIPATIONS, {"count": releases(context) + 1})


def accounted_rounds(server_round: int, released: int) -> int:
    """The rounds the client's budget is charged for after this one: never fewer than its own releases + 1."""
    return max(int(server_round), int(released) + 1)
