"""A node's own privacy policy: what the run-config (the submitter's, i.e. the server's) may not decide for it.

In a deployment ``Context.run_config`` comes from whoever submits the run; only node-config belongs to the SuperNode's
operator. The run-config keys that would weaken a node's guarantee are therefore checked on the node, against its
node-config, before it trains (:meth:`NodePolicy.refusal`; enforced by ``fedapp.clients.guard.GuardedClient``):

==========================  ===========================================================  ==================
node-config key             what the run-config may then ask for                          SuperNode default
==========================  ===========================================================  ==================
``allow-seeded-noise``      ``seeded-noise = true`` (noise and sampling from a seed the     false
                            server knows: it voids every guarantee)
``allow-release-adversary`` ``client-dp-adversary = 'release'`` (a budget amplified by      false
                            sampling the server itself draws; σ 1.45 instead of 4.38 in
                            docs/privacy.md's example)
``allow-large-delta``       ``allow-large-delta = true`` (δ above 1/(10 N))                 false
``allow-add-remove``        ``record-neighbours = 'add-remove'`` (half the noise for a      false
                            relation the released N_i voids)
``max-epsilon``             a run whose planned ε for this node exceeds it is refused:      none
                            record-level its ε_i, client-level the planned ε against the
                            server that draws the sample (q = 1, all ``dp-rounds``)
==========================  ===========================================================  ==================

Alongside them the client-level floors ``min-round-clients`` and ``min-noise-multiplier``
(``fedapp.clients.client_level_guard``) and the lifetime budget (``fedapp.state.lifetime_budget``) stay as they are.

In a simulation every node is the submitter's own (one person runs the server and all clients on one machine), so the
``allow-*`` defaults are true there; a key the node-config sets is honoured in both. Where a ClientApp runs is
``fedapp.compat.runtime.on_supernode``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from fedapp.config import ConfigError, RunConfig

#: node-config switches that let the run-config weaken this node's guarantee, with the run-config key each governs
ALLOW_KEYS = {"allow-seeded-noise": "seeded-noise", "allow-release-adversary": "client-dp-adversary",
              "allow-large-delta": "allow-large-delta", "allow-add-remove": "record-neighbours"}
#: every node-config key of the policy, with its type (the launchers' node-config parser uses it)
POLICY_KEYS: dict[str, type] = {**dict.fromkeys(ALLOW_KEYS, bool), "max-epsilon": float}


def node_bool(node_config: Mapping[str, Any], key: str, default: bool) -> bool:
    """A node-config boolean: a TOML bool, or the strings true/false (``ConfigError`` naming the key otherwise)."""
    if key not in node_config:
        return default
    raw = node_config[key]
    if isinstance(raw, bool):
        return raw
    if isinstance(raw, str) and raw.strip().lower() in ("true", "false"):
        return raw.strip().lower() == "true"
    raise ConfigError(f"node-config {key!r} expects true or false, got {raw!r}")


@dataclass(frozen=True)
class NodePolicy:
    """The run-config settings this node accepts (see the module docstring)."""

    allow_seeded_noise: bool = False
    allow_release_adversary: bool = False
    allow_large_delta: bool = False
    allow_add_remove: bool = False
    max_epsilon: float | None = None
    on_supernode: bool = True

    @classmethod
    def from_node_config(cls, node_config: Mapping[str, Any], on_supernode: bool) -> NodePolicy:
        default = not on_supernode  # a simulation's nodes are the submitter's own
        cap = None
        if "max-epsilon" in node_config:
            raw = node_config["max-epsilon"]
            try:
                cap = float(raw)
            except (TypeError, ValueError):
                cap = math.nan
            if isinstance(raw, bool) or not (cap > 0 and math.isfinite(cap)):
                raise ConfigError(f"node-config 'max-epsilon' = {raw!r} must be a number > 0")
        return cls(allow_seeded_noise=node_bool(node_config, "allow-seeded-noise", default),
                   allow_release_adversary=node_bool(node_config, "allow-release-adversary", default),
                   allow_large_delta=node_bool(node_config, "allow-large-delta", default),
                   allow_add_remove=node_bool(node_config, "allow-add-remove", default),
                   max_epsilon=cap, on_supernode=on_supernode)

    def refusal(self, cfg: RunConfig, planned_epsilon: float | None) -> str | None:
        """Why this node does not train in the run ``cfg`` (None when it may). ``planned_epsilon`` is the ε the run
        plans for this node against the server (None when the run has no DP)."""
        where = "this SuperNode's" if self.on_supernode else "this node's"
        asks = [(self.allow_seeded_noise or not cfg.general.seeded_noise, "allow-seeded-noise", "seeded-noise = true"),
                (self.allow_release_adversary or cfg.client_dp.client_dp_adversary != "release",
                 "allow-release-adversary", "client-dp-adversary = 'release'"),
                (self.allow_large_delta or not cfg.training.allow_large_delta, "allow-large-delta",
                 "allow-large-delta = true"),
                (self.allow_add_remove or cfg.training.record_neighbours != "add-remove", "allow-add-remove",
                 "record-neighbours = 'add-remove'")]
        for allowed, key, setting in asks:
            if not allowed:
                return (f"the run-config sets {setting}, which {where} privacy policy does not accept (node-config "
                        f"{key!r} is false); the node does not train in this run")
        if self.max_epsilon is not None and planned_epsilon is not None and planned_epsilon > self.max_epsilon:
            return (f"the run plans epsilon {planned_epsilon:.4g} for this node, above {where} node-config "
                    f"'max-epsilon' = {self.max_epsilon:g}; the node does not train in this run")
        return None


def node_refusal(cfg: RunConfig, node_config: Mapping[str, Any], on_supernode: bool) -> str | None:
    """Why the node of ``node_config`` does not train in the run ``cfg`` (None when its policy accepts it); the planned
    ε is computed only when the node caps it."""
    policy = NodePolicy.from_node_config(node_config, on_supernode)
    eps = planned_epsilon(cfg, node_config) if policy.max_epsilon is not None else None
    return policy.refusal(cfg, eps)


def planned_epsilon(cfg: RunConfig, node_config: Mapping[str, Any]) -> float | None:
    """The ε the run ``cfg`` plans for this node against the server that configures it (None without DP): its own ε_i
    for record-level DP (node-config ``epsilon`` when set), else the client-level mechanism's over all planned rounds
    at q = 1 (no amplification: that server draws the sample), DP-FTRL's for the whole run."""
    from fedapp.registry import get_spec

    mechanism = get_spec(cfg.general.strategy).mechanism  # fedapp.apps.mechanisms
    n = int(node_config["num-partitions"]) if "num-partitions" in node_config else 0  # record-level: not read
    return mechanism.planned_epsilon(cfg, n, node_config)
