"""Admission of one round's replies: identity, strikes, the ledger's charge, validation (framework-free).

:func:`admit` turns one :class:`Reply` into an accepted :class:`ClientUpdate` or a rejected record. The
family's hooks (:class:`AdmissionHost`) say how a reply is recorded, charged and decoded; everything else
(who is struck, when a charge is provisional, what a secure sum's failure means) is decided here, once.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Container, Mapping, Sequence
from dataclasses import dataclass, field
from logging import WARNING
from typing import Any, Protocol

import numpy as np

from strategies.privacy.accountants import History
from strategies.privacy.ledger import PrivacyLedger
from strategies.server.identity import IdentityBinding
from strategies.server.records import empty_client_record
from strategies.server.validation import (
    RejectedUpdate,
    StrikeRecord,
    UpdateValidator,
    metric_problem,
    parse_client_id,
)

log = logging.getLogger("flwr").log  # Flower's logger: the server's decisions appear in the run's log

#: (history, δ) or (history, δ, record-level relation) charged to one client
Charge = tuple[History, float] | tuple[History, float, str]


@dataclass
class Reply:
    """One client's fit reply, as the engine reads it (the Flower adapter builds it from ``FitRes``)."""

    node_id: int
    num_examples: int
    metrics: dict[str, Any]
    tensors: Sequence[bytes]  # the payload as sent (its size is the uplink)
    arrays: Callable[[], list[np.ndarray]]  # the payload decoded; may raise on hostile bytes


@dataclass
class Failure:
    """A client that did not reply: its node (None: unknown), the client id it carries, and why."""

    node_id: int | None
    client_id: int | None
    reason: str


@dataclass
class ClientUpdate:
    """One accepted client contribution of a round."""

    node_id: int
    client_id: int
    num_examples: int
    update: np.ndarray  # flat float64 vector, same length as the model
    metrics: dict[str, Any]
    uplink_bytes: int
    record: dict[str, Any] = field(default_factory=dict)


class AdmissionHost(Protocol):
    """What admission needs from a strategy: its collaborators and the family's per-reply hooks."""

    identity: IdentityBinding
    strikes: StrikeRecord
    node_strikes: StrikeRecord
    ledger: PrivacyLedger
    validator: UpdateValidator
    declared: dict[int, tuple[float, float]]

    @property
    def payload_is_shared(self) -> bool: ...

    def client_record(self, reply: Reply, metrics: Mapping[str, Any]) -> dict[str, Any]: ...

    def privacy_charge(self, server_round: int, record: Mapping[str, Any],
                       metrics: Mapping[str, Any]) -> Charge | None: ...

    def decode_update(self, server_round: int, reply: Reply, metrics: Mapping[str, Any]) -> np.ndarray: ...

    def validate_update(self, update: np.ndarray, metrics: Mapping[str, Any]) -> None: ...


def admit(fam: AdmissionHost, server_round: int, reply: Reply, connected: set[int], contested: set[int],
          records: list[dict[str, Any]]) -> ClientUpdate | None:
    """Record one reply; decode, validate and charge it; the accepted update or None. Never raises.

    Who is struck (:func:`strike`): a node that claims a client id bound to another node (the newcomer, never the
    owner); a client whose own reply is out of bounds once its id is bound to the replying node; the *node* of a
    reply rejected before its claim is established (malformed metrics or status for an unbound id). Nobody is
    struck for a client id that several unbound nodes claim in one round with usable metrics (the server cannot
    tell which is honest: every claim is rejected and charged; :func:`contested_ids`), for a failure the client
    reports itself, or for a payload that is a secure sum (``payload_is_shared``: it cannot be attributed to one
    client).
    """
    metrics = dict(reply.metrics)
    node = reply.node_id
    try:
        record = fam.client_record(reply, metrics)
    except Exception as exc:  # a family hook choking on hostile metrics must not end the run
        record = {**empty_client_record(), "node_id": node, "status": "rejected",
                  "reason": f"unreadable reply: {type(exc).__name__}: {exc}"}
    records.append(record)
    if record["status"] == "rejected":
        strike(fam, server_round, record)
        return None
    problem = metric_problem(metrics)
    cid = record["client_id"]
    if problem is None:
        reason = fam.identity.check(node, cid, connected)
        if reason is not None:  # a newcomer claiming a bound id: the node is struck, the owner keeps its id
            record.update(status="rejected", reason=reason, identity_violation=True)
            strike_node(fam, server_round, record)
            return None
        if cid in contested and fam.identity.node_of.get(cid) != node:
            released = record["status"] in ("ok", "failed")  # the claim says it trained
            record.update(status="rejected", contested=True,
                          reason=f"client_id {cid} is claimed by several unbound nodes this round: every claim is "
                                 "rejected and charged, none is struck")
            log(WARNING, "round %d: node %d: %s", server_round, node, record["reason"])
            if released:
                charge_contested(fam, server_round, record, metrics)
            return None
    stage = "metrics"
    try:
        if problem is not None:
            raise RejectedUpdate(problem)
        if fam.strikes.excluded(cid):
            raise RejectedUpdate(f"client {cid} is excluded after {fam.strikes.limit} rejected updates")
        fam.identity.bind(node, cid)
        fam.ledger.register(cid)
        if record["status"] not in ("ok", "failed"):
            return None
        charge = fam.privacy_charge(server_round, record, metrics)
        if charge is not None:  # the client trained (and released its update): charge before validating it
            fam.ledger.charge(cid, *charge)
        if record["status"] == "failed":  # trained and failed on its own: charged, not struck
            return None
        fam.validator.check_examples(cid, int(reply.num_examples))
        stage = "payload"
        try:
            update = fam.decode_update(server_round, reply, metrics)
        except RejectedUpdate:
            raise
        except Exception as exc:  # undecodable bytes, bad encodings: the payload is hostile or broken
            raise RejectedUpdate(f"undecodable payload: {type(exc).__name__}: {exc}") from None
        update = np.asarray(update, dtype=np.float64)
        fam.validator.check_values(update)
        fam.validate_update(update, metrics)
    except Exception as exc:  # noqa: BLE001 — one client's payload never ends the run
        reason = str(exc) if isinstance(exc, RejectedUpdate) else \
            f"server error on this payload: {type(exc).__name__}: {exc}"
        record["status"], record["reason"] = "rejected", reason
        if stage == "payload" and fam.payload_is_shared:
            record["attributable"] = False  # a secure sum: no single client can be blamed for it
            log(WARNING, "round %d: the secure sum failed validation (%s); nobody is struck", server_round, reason)
        else:
            strike(fam, server_round, record)
        return None
    return ClientUpdate(node, cid, int(reply.num_examples), update, metrics, int(record["uplink_bytes"]), record)


def contested_ids(replies: Sequence[Reply], statuses: Container[str]) -> set[int]:
    """Client ids claimed by more than one reply of the round whose metrics are usable (:func:`metric_problem`)
    and whose status is one of ``statuses``. Any other reply is rejected whatever it claims, so it contests nobody:
    an outsider's malformed claim cannot keep the id's honest owner out of the round."""
    claims = Counter(parse_client_id(r.metrics.get("client_id")) for r in replies
                     if metric_problem(r.metrics) is None and r.metrics.get("status", "ok") in statuses)
    return {cid for cid, n in claims.items() if cid is not None and n > 1}


def charge_contested(fam: AdmissionHost, server_round: int, record: dict[str, Any], metrics: Mapping[str, Any]) -> None:
    """Charge a contested claim's declared mechanism to the claimed id (one of the claims is the honest
    client's release, and the server cannot tell which), without fixing anyone's declaration."""
    cid = int(record["client_id"])
    known = cid in fam.declared
    try:
        charge = fam.privacy_charge(server_round, record, metrics)
    except RejectedUpdate:
        return  # differs from the declaration fixed earlier: the honest claim is the one that matches it
    finally:
        if not known:
            fam.declared.pop(cid, None)
    if charge is not None:
        fam.ledger.register(cid)
        if len(charge) == 3:  # (history, delta, relation)
            fam.ledger.charge(cid, charge[0], charge[1], charge[2], provisional=True)
        else:  # (history, delta): the ledger's default relation
            fam.ledger.charge(cid, charge[0], charge[1], provisional=True)


def screen_outliers(fam: AdmissionHost, server_round: int, updates: list[ClientUpdate]) -> None:
    """Reject updates far above the reference norms of :meth:`UpdateValidator.norm_outliers` (mechanisms without a
    declared bound): struck, unless the rejection is not attributable (``attributable: false``, nobody is struck).
    The norms accepted then join the cross-round reference (:meth:`UpdateValidator.remember`)."""
    norms = [float(np.linalg.norm(u.update)) for u in updates]
    outliers = fam.validator.norm_outliers(norms)
    for u, outlier in zip(updates, outliers):
        if outlier is None:
            continue
        u.record["status"], u.record["reason"] = "rejected", outlier.reason
        if outlier.attributable:
            strike(fam, server_round, u.record)
        else:
            u.record["attributable"] = False
            log(WARNING, "round %d: rejected reply of node %s (client %s), nobody is struck: %s", server_round,
                u.record.get("node_id"), u.record.get("client_id"), outlier.reason)
    fam.validator.remember([n for n, o in zip(norms, outliers) if o is None],
                           unattributed=any(o is not None and not o.attributable for o in outliers))


def strike(fam: AdmissionHost, server_round: int, record: dict[str, Any]) -> None:
    """Strike the sender of a rejected reply: the client id when its claim is established (the id is bound to the
    replying node), else the node. A reply rejected before its claim was checked (malformed metrics, an unknown
    status) never costs the id it names: that id may belong to an honest client on another node."""
    log(WARNING, "round %d: rejected reply of node %s (client %s): %s", server_round, record.get("node_id"),
        record.get("client_id"), record.get("reason"))
    cid = record.get("client_id")
    if cid is None or fam.identity.node_of.get(cid) != record.get("node_id"):
        strike_node(fam, server_round, record)  # an unestablished or spoofed claim counts against its node
        return
    if fam.strikes.add(cid, str(record.get("reason"))):
        log(WARNING, "client %s is excluded from later rounds after %d rejected updates", cid, fam.strikes.limit)
        record["excluded"] = True


def strike_node(fam: AdmissionHost, server_round: int, record: dict[str, Any]) -> None:
    """Strike the node of a rejected reply (an identity violation, or a reply whose claim was not established)."""
    node = record.get("node_id")
    log(WARNING, "round %d: node %s is struck: %s", server_round, node, record.get("reason"))
    if node is not None and fam.node_strikes.add(int(node), str(record.get("reason"))):
        log(WARNING, "node %s is excluded from later rounds after %d rejected replies", node, fam.node_strikes.limit)
        record["excluded"] = True


def failure_record(fam: AdmissionHost, failure: Failure) -> dict[str, Any]:
    """The record of a client that did not reply: the client bound to its node, else the id it carried."""
    rec = empty_client_record()
    rec.update(node_id=failure.node_id, status="failed", reason=failure.reason)
    node_cid = fam.identity.client_of.get(failure.node_id) if failure.node_id is not None else None
    rec["client_id"] = node_cid if node_cid is not None else failure.client_id
    return rec


def fill_ledger_fields(ledger: PrivacyLedger, records: list[dict[str, Any]]) -> None:
    """The server's ε into every record; a disagreeing client report is flagged."""
    for rec in records:
        cid = rec.get("client_id")
        if cid is None or not ledger.charged(cid):  # non-private: no ε at all, which is not ε = 0
            continue
        rec["epsilon_spent"] = ledger.epsilon(cid)
        note = ledger.mismatch(cid, rec.get("client_epsilon_spent")) if rec.get("status") == "ok" else None
        if note is not None:
            rec["epsilon_mismatch"] = note
            log(WARNING, "client %s: %s", cid, note)

