"""What a family supplies to the round engine: the methods marked *hook*, each with the default most
families keep (plain FedAvg over record-level DP-SGD replies).

A family (one paper: :mod:`strategies.robust_hdp`, :mod:`strategies.fed_smp`, ...) overrides the few hooks its
math changes; :class:`~strategies.engine.RoundEngine` calls them in a round's order: ``prepare_round`` →
``sample_clients`` → ``fit_config`` → per reply ``client_record``, ``privacy_charge``, ``decode_update``,
``validate_update`` → ``screen`` → ``population_charge`` → ``aggregation_weights``, ``aggregate_updates`` →
``after_aggregate`` → ``model_metrics``, ``evaluates``, ``evaluate_config``; ``checkpoint_state`` and
``random_generators`` when a checkpoint is written.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from strategies.aggregate import weighted_sum
from strategies.privacy import threat_models
from strategies.privacy.ledger import PrivacyLedger
from strategies.server.admission import Charge, ClientUpdate, Reply
from strategies.server.identity import IdentityBinding
from strategies.server.records import empty_client_record, jsonable
from strategies.server.sampling import ClientSampler
from strategies.server.validation import (
    NUMERIC_METRICS,
    RejectedUpdate,
    StrikeRecord,
    UpdateValidator,
    number_metrics,
    parse_client_id,
    short_repr,
)

#: statuses a client may report: trained (``ok``), would not train (``refused``: budget, data), or trained and
#: failed on its own (``failed``: e.g. DP-SGD diverged) — a failure, never a strike
CLIENT_STATUSES = ("ok", "refused", "failed")


class FamilyHooks:
    """The hooks of a family, with their defaults; the collaborators they read are the engine's."""

    name = "base"
    privacy = threat_models.NONE  #: threat model in one line (README/docs and ``config.json``)
    max_update_norm: float | None = None  #: declared ℓ2 bound of a legitimate update (None = none)
    send_ledger: bool = True  #: send each node its ε on the ledger (``dp-ledger``): catches a lost accountant

    fraction_evaluate: float
    evaluate_every: int
    num_rounds: int
    sampler: ClientSampler
    identity: IdentityBinding
    strikes: StrikeRecord
    node_strikes: StrikeRecord
    ledger: PrivacyLedger
    validator: UpdateValidator
    declared: dict[int, tuple[float, float]]  # client_id -> declared (z, q) of its DP-SGD

    def declared_norm_bound(self, dim: int) -> float | None:
        """*hook*: the ℓ2 bound a legitimate update of ``dim`` coordinates stays below (None = none)."""
        return self.max_update_norm

    def prepare_round(self, num_available: int) -> None:
        """*hook*: called with the connected count before each round is configured."""

    def fit_config(self, server_round: int) -> dict[str, Any]:
        """*hook*: extra keys sent to clients with the global model."""
        return {}

    def evaluate_config(self, server_round: int) -> dict[str, Any]:
        """*hook*: extra keys sent with federated evaluation."""
        return {}

    def sample_clients(self, server_round: int, nodes: list[int]) -> list[int]:
        """*hook*: node ids of this round (the :class:`ClientSampler`'s choice), minus excluded clients."""
        return self.sampler.sample(server_round, [n for n in nodes if not self.node_strikes.excluded(n)
                                                  and not self.strikes.excluded(self.identity.client_of.get(n))])

    def client_record(self, reply: Reply, metrics: Mapping[str, Any]) -> dict[str, Any]:
        """*hook*: the round record of one reply: claimed id, size, numeric metrics, the client's ε claim, status
        (families add fields)."""
        rec = empty_client_record()
        rec["client_id"] = parse_client_id(metrics.get("client_id"))
        rec["node_id"] = reply.node_id
        rec["num_examples"] = int(reply.num_examples)
        rec["uplink_bytes"] = int(sum(len(t) for t in reply.tensors))
        for key in NUMERIC_METRICS:
            if key in metrics and isinstance(metrics[key], (int, float, np.integer, np.floating)):
                rec[key] = jsonable(metrics[key])
        rec["client_epsilon_spent"] = rec.pop("epsilon_spent")  # the client's word; the ledger's value replaces it
        rec["epsilon_spent"] = None
        status = metrics.get("status", "ok")
        rec["status"] = status if status in CLIENT_STATUSES else "rejected"
        rec["reason"] = str(metrics.get("reason", "")) or None
        if status not in CLIENT_STATUSES:
            rec["reason"] = f"unknown status {short_repr(status)}"
        return rec

    def privacy_charge(self, server_round: int, record: Mapping[str, Any], metrics: Mapping[str, Any]) -> Charge | None:
        """*hook*: (history, δ) or (history, δ, relation) the server charges to the client of an ``ok`` reply
        (None = nothing); ``relation`` is the record-level neighbouring relation the ledger composes it under.

        Default, record-level DP-SGD: the declared (z, q) and the round's steps, with z and q fixed for the run
        at first contact (a client cannot lower its noise later), under the relation the reply declares
        (``record_neighbours``; replace-one when it declares none, the relation that fits a reply carrying
        N_i), fixed at first contact too.
        """
        values = number_metrics(metrics, "noise_multiplier", "sample_rate", "steps_round", "delta")
        if values is None:
            return None
        z, q, steps, delta = float(values[0]), float(values[1]), int(values[2]), float(values[3])
        if not (z > 0 and 0 < q <= 1 and steps > 0 and 0 < delta < 1):
            raise RejectedUpdate(f"declared mechanism (noise_multiplier={z}, sample_rate={q}, steps_round={steps}, "
                                 f"delta={delta}) is not a valid subsampled Gaussian")
        relation = self.fix_record_level(record, metrics, (z, q), "(noise_multiplier, sample_rate)")
        return [(z, q, steps)], delta, relation

    def fix_record_level(self, record: Mapping[str, Any], metrics: Mapping[str, Any], mechanism: tuple[float, float],
                         what: str) -> str:
        """The record-level relation a reply declares (``record_neighbours``) and its mechanism, both fixed for the
        client at first contact; a change of either raises :class:`RejectedUpdate`. Returns the relation."""
        cid = int(record["client_id"])
        try:
            relation = self.ledger.declared_relation(cid, metrics.get("record_neighbours"))
        except ValueError as exc:
            raise RejectedUpdate(str(exc)) from None
        self.fix_declared(cid, mechanism, what)
        return relation

    def fix_declared(self, client_id: int, mechanism: tuple[float, float], what: str) -> None:
        """Fix a client's declared mechanism at first contact; a later, different declaration is rejected
        (a client cannot declare less noise once the server has started charging it)."""
        first = self.declared.setdefault(client_id, mechanism)
        if first != mechanism:
            raise RejectedUpdate(f"declared {what} = {mechanism} differs from the {first} client {client_id} "
                                 "declared first")

    def decode_update(self, server_round: int, reply: Reply, metrics: Mapping[str, Any]) -> np.ndarray:
        """*hook*: the flat update vector of a reply. Default: dense arrays of the model's shapes."""
        return self.validator.decode_dense(reply.arrays())

    def validate_update(self, update: np.ndarray, metrics: Mapping[str, Any]) -> None:
        """*hook*: raise :class:`RejectedUpdate` for an update that must not be aggregated (extra family checks)."""

    @property
    def payload_is_shared(self) -> bool:
        """*hook*: True when every reply carries the same secure sum instead of the client's own update."""
        return False

    def screen(self, server_round: int, updates: list[ClientUpdate]) -> list[tuple[ClientUpdate, str]]:
        """*hook*: (update, reason) pairs to reject with the whole round in view (e.g. Robust-HDP's noise estimates)."""
        return []

    def population_charge(self, server_round: int, accepted: list[ClientUpdate],
                          records: list[dict[str, Any]]) -> dict[str, Any]:
        """*hook*: charge a round-wide mechanism to the population (client-level DP); returns round metrics.
        ``round_withheld: True`` releases nothing of the round."""
        return {}

    def aggregation_weights(self, server_round: int, updates: list[ClientUpdate]) -> tuple[np.ndarray, dict[str, Any]]:
        """*hook*: raw weights (normalized by the caller) and extra round metrics. Default w_i ∝ N_i."""
        return np.asarray([max(u.num_examples, 0) for u in updates], dtype=np.float64), {}

    def aggregate_updates(self, server_round: int, updates: list[ClientUpdate], weights: np.ndarray) -> np.ndarray:
        """*hook*: combine updates with normalized weights. Default Σ w_i Δ_i."""
        return weighted_sum([u.update for u in updates], weights)

    def after_aggregate(self, server_round: int, updates: list[ClientUpdate], weights: np.ndarray) -> None:
        """*hook*: called after the global model moved (e.g. to update server state)."""

    def evaluates(self, server_round: int) -> bool:
        """*hook*: whether clients evaluate the model of this round."""
        return self.fraction_evaluate > 0 and self.evaluation_round(server_round)

    def evaluation_round(self, server_round: int) -> bool:
        """Every ``evaluate_every`` rounds (run-wide count) and the last: when the global model is evaluated."""
        return server_round % self.evaluate_every == 0 or server_round >= self.num_rounds

    def model_metrics(self, weights: list[np.ndarray]) -> dict[str, Any]:
        """*hook*: extra metrics of the global model, computed by the server after each round."""
        return {}

    def checkpoint_state(self) -> dict[str, Any]:
        """*hook*: family server state to checkpoint (numpy arrays and JSON values, nested freely)."""
        return {}

    def random_generators(self) -> dict[str, np.random.Generator]:
        """*hook*: the family's own generators, by name: checkpointed so that a resumed run continues them."""
        return {}

    def load_checkpoint_state(self, state: Mapping[str, Any]) -> None:
        """*hook*: restore what :meth:`checkpoint_state` returned."""
