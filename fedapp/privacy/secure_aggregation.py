"""Flower SecAgg+ for the client-level DP families: the server learns only the sum of the sampled updates.

Client-level DP (``strategies/client_level.py``) sizes each client's noise so that the *sum* of the r_t
sampled updates carries σC. That aggregate guarantee holds against the server only if it never sees an
individual update; Flower's SecAgg+ (Bell et al. 2020) provides exactly that: clients quantize and mask
their update with pairwise and private masks, the server sums the masked vectors and removes the masks
with Shamir shares, and only the weighted average of the survivors reaches ``Strategy.aggregate_fit``.

How the pieces fit:

* clients report ``num_examples = 1`` under SecAgg, so the average is uniform, (1/r') Σ Δ_i over the
  r' survivors; a client that does not contribute (budget refusal, lost state, fault) raises instead of
  replying, which SecAgg+ handles as a dropout (its masks are reconstructed from the neighbours' shares),
  and the reason reaches the server log as the failure message;
* the clipping range of the quantizer follows the round's mechanism, C + 12 noise stds
  (:meth:`strategies.client_level.ClientLevelDPStrategy.secagg_clipping_range`), so clipping by the
  quantizer is a < e⁻⁷² event and the quantization error (unbiased, ≤ 2·range/2²² per coordinate) is far
  below the DP noise — ``tests/integration/fedapp/privacy/test_secure_aggregation.py`` measures it;
* the strategy receives every survivor's metrics in the clear (client id, status, declared σ) with the
  same aggregate as parameters; it validates the metrics, charges the ledger for r' of r_t and, when any
  contribution is invalid (it cannot be separated from the sum), withholds the whole round.

Two mechanisms ride on it (run-config ``secagg-mechanism``):

* ``ddg`` (default), the distributed discrete Gaussian (``strategies/privacy/discrete_gaussian.py``): each client
  sends a residue modulo 2^b of its rotated, scaled, conditionally rounded update plus discrete Gaussian noise,
  and the server learns the residue of the sum, which is what Kairouz, Liu and Steinke (2021) prove private.
  Flower's quantizer carries the residues exactly: with Q = 2^b − 1 levels, clipping range Q/2, weight 1
  and a field of 2^b, a client value u − Q/2 (u its residue) quantizes to u itself (every step is an exact
  float operation), masks are added modulo 2^b, and Flower's dequantized mean w = (s − r'Q/2)·Q/(2^b − r') of
  r' survivors gives back the residue s of the sum (:func:`residues_from_mean`). Clients check the field the
  server set up before they send (a wider field would reveal how often the shares wrapped);
* ``gaussian``: continuous Gaussian noise, then Flower's stochastic quantizer (2^22 levels, clipping range C plus
  12 noise stds, a field wide enough for the cohort). The rounding noise is far below the DP noise, but the
  privacy of that rounded sum is not analysed. Under adaptive clipping (Andrew et al. 2021) each client's vector has
  one more coordinate, its noised centred bit times
  :func:`~strategies.privacy.adaptive_clipping.count_share_scale` (which maps the bit's range ½ + 12 stds onto the
  same clipping range, so it is quantized with the same relative precision); the strategy splits it off the sum
  (:meth:`~strategies.server.secure_sum.SecureSumAdapter.split_count`). Not with ``ddg``.

Metadata SecAgg+ does not hide: who took part (the server samples and talks to each client), timing,
and the clients' metrics.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
from flwr.app import ConfigRecord, Context, Message
from flwr.app.message_type import MessageType
from flwr.client.mod import secaggplus_mod
from flwr.common import ndarrays_to_parameters, parameters_to_ndarrays
from flwr.common.secure_aggregation.quantization import quantize
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, RECORD_KEY_STATE, Stage
from flwr.compat.common.recorddict_compat import fitres_to_recorddict, recorddict_to_fitres
from flwr.server import ServerConfig
from flwr.server.compat import LegacyContext
from flwr.server.workflow import DefaultWorkflow, SecAggPlusWorkflow
from flwr.server.workflow.constant import MAIN_CONFIGS_RECORD
from flwr.server.workflow.constant import Key as WorkflowKey
from flwr.serverapp.grid import Grid

from fedapp.compat.secagg import use_key_agreement, use_masks, use_shamir
from fedapp.config import ClientDPConfig, DeploymentConfig
from fedapp.privacy import key_agreement, masks, shamir
from strategies.client_level import CFG_ROUND_CLIENTS

#: SecAgg+ weights each masked update by num_examples / max_weight; clients send 1 (a uniform sum)
MAX_WEIGHT = 1.0
#: Flower SecAgg+'s quantization levels per coordinate for continuous Gaussian shares
QUANTIZATION_RANGE = 2**22
#: the legacy message's record of the fit config (Flower's ``fitins_to_recorddict``)
FIT_CONFIG = "fitins.config"
#: fit metric: the bit width of a distributed discrete Gaussian share (absent: a continuous share)
SECAGG_BITS = "secagg_bits"


def ddg_transport(bits: int) -> dict[str, Any]:
    """Flower SecAgg+ parameters that carry residues modulo 2^b exactly (see the module docstring)."""
    levels = (1 << bits) - 1
    return {"clipping_range": levels / 2, "quantization_range": levels, "modulus_range": 1 << bits,
            "max_weight": MAX_WEIGHT}


def residues_from_mean(mean: np.ndarray, bits: int, survivors: int) -> np.ndarray:
    """The residue modulo 2^b of the survivors' sum from Flower's dequantized mean under :func:`ddg_transport`."""
    levels, modulus = (1 << bits) - 1, 1 << bits
    s = np.rint(np.asarray(mean, dtype=np.float64) * (modulus - survivors) / levels + survivors * levels / 2)
    return np.mod(s, modulus)


class DPSecAggPlusWorkflow(SecAggPlusWorkflow):
    """Flower's SecAgg+ workflow with the quantizer's clipping range taken from the round's mechanism.

    The Flower symbols it overrides or relies on (the base class's ``__init__`` and the attributes it assigns, the two
    stages, their state, Flower's quantizer) are registered in :mod:`fedapp.compat.surface` (groups ``secagg.workflow``
    and ``secagg.transport``), whose test fails when a Flower upgrade changes them."""

    def __init__(self, strategy: Any, **kwargs: Any) -> None:
        self.strategy = strategy
        super().__init__(**kwargs)

    # Flower declares the three ranges as plain attributes its __init__ assigns; here each is a property derived
    # from the round's mechanism (with a setter that ignores the base class's assignment). mypy flags a property
    # overriding an attribute, hence the three ``type: ignore[override]``.
    @property  # type: ignore[override]
    def clipping_range(self) -> float:
        ddg = getattr(self.strategy, "ddg", None)
        if ddg is not None:
            return float(ddg_transport(ddg.bits)["clipping_range"])
        return float(self.strategy.secagg_clipping_range())

    @clipping_range.setter
    def clipping_range(self, value: float) -> None:  # the base class assigns its default; the mechanism rules
        pass

    @property  # type: ignore[override]
    def modulus_range(self) -> int:
        """The field of this round's modular sum: 2^b for the discrete Gaussian, else wide enough for the round's
        cohort (:func:`modulus_for`)."""
        ddg = getattr(self.strategy, "ddg", None)
        if ddg is not None:
            return int(ddg_transport(ddg.bits)["modulus_range"])
        return modulus_for(self.strategy.round_clients(), self.quantization_range)

    @modulus_range.setter
    def modulus_range(self, value: int) -> None:  # sized per round from the cohort
        pass

    @property  # type: ignore[override]
    def quantization_range(self) -> int:
        ddg = getattr(self.strategy, "ddg", None)
        return int(ddg_transport(ddg.bits)["quantization_range"]) if ddg is not None else QUANTIZATION_RANGE

    @quantization_range.setter
    def quantization_range(self, value: int) -> None:  # follows the mechanism
        pass

    def unmask_stage(self, grid: Grid, context: LegacyContext, state: Any) -> bool:
        """Flower's unmask stage, entered only when the strategy can release and pay for the sum.

        The survivors' metrics arrive with their masked vectors; the strategy checks them and its budget for
        the sum of ``len(survivors)`` updates first (:meth:`~strategies.client_level.ClientLevelDPStrategy.
        unmask_refusal`). A refused round is recorded and its sum is never reconstructed; a reconstructed sum is
        always charged.
        """
        workflow: Mapping[str, Any] = context.state.config_records[MAIN_CONFIGS_RECORD]
        current_round = int(workflow[WorkflowKey.CURRENT_ROUND])
        reason = self.strategy.unmask_refusal(current_round, state.legacy_results)
        if reason is not None:
            self.strategy.record_unreconstructed(current_round, state.legacy_results, state.failures, reason)
            return False
        ddg = getattr(self.strategy, "ddg", None)
        if ddg is None:
            return super().unmask_stage(grid, context, state)
        strategy = context.strategy  # Flower hands the dequantized mean to aggregate_fit: give it the residues
        context.strategy = _ResidueSum(strategy, ddg.bits)  # type: ignore[assignment]  # only aggregate_fit is called
        try:
            return super().unmask_stage(grid, context, state)
        finally:
            context.strategy = strategy

    def collect_masked_vectors_stage(self, grid: Grid, context: LegacyContext, state: Any) -> bool:
        """Flower's stage, with each dropped client's failure recorded once (flwr 1.41 appends it twice)."""
        before = len(state.failures)
        ok = super().collect_masked_vectors_stage(grid, context, state)
        new = state.failures[before:]
        half = len(new) // 2
        if len(new) % 2 == 0 and [repr(e) for e in new[:half]] == [repr(e) for e in new[half:]]:
            del state.failures[before + half:]
        return ok


class _ResidueSum:
    """The strategy as Flower's unmask stage calls it, with the dequantized mean turned back into the residue of
    the sum modulo 2^b before ``aggregate_fit`` (:func:`residues_from_mean`)."""

    def __init__(self, strategy: Any, bits: int) -> None:
        self.strategy, self.bits = strategy, bits

    def aggregate_fit(self, server_round: int, results: list[Any], failures: list[Any]) -> Any:
        if results:
            mean = parameters_to_ndarrays(results[0][1].parameters)
            residues = ndarrays_to_parameters([residues_from_mean(a, self.bits, len(results)) for a in mean])
            for _, res in results:
                res.parameters = residues
        return self.strategy.aggregate_fit(server_round, results, failures)


#: the widest field the int64 arithmetic of Flower's SecAgg+ sums without overflow (two values below it add up
#: to less than 2⁶³)
MAX_MODULUS = 2**62


def modulus_for(cohort: int, quantization_range: int) -> int:
    """The smallest power of two (at least Flower's 2³²) above the largest sum of ``cohort`` quantized updates.

    Each client's quantized coordinate lies in [0, ``quantization_range``] (weight 1), so the modular sum of a
    cohort of r is exact when the modulus exceeds r·Q; Flower's default 2³² wraps from r = 1,024 on (Q = 2²²).
    """
    need = max(int(cohort), 1) * int(quantization_range) + 1
    modulus = max(2**32, 1 << (need - 1).bit_length())
    if modulus > MAX_MODULUS:
        raise ValueError(f"a secure sum of {cohort} updates quantized to {quantization_range} levels needs a field of "
                         f"{modulus}, more than SecAgg+'s int64 arithmetic holds ({MAX_MODULUS})")
    return modulus


BYTES_KEY = "dpfl-secagg-bytes"  # Context.state: SecAgg+ bytes this client sent so far in the round
FIT_METRICS = "fitres.metrics"  # the legacy FitRes metrics record of a reply (flwr compat naming)


#: why a client configured for SecAgg+ refuses a fit that does not come through it
OUTSIDE_SECAGG = ("secure aggregation: this fit did not come through SecAgg+'s collect stage (the server sent a plain "
                  "fit, or the ClientApp lacks secagg_mod); this client's share is noised for a sum of the round's "
                  "clients and is never sent alone")


def outside_secagg(context: Context | None) -> bool:
    """Whether a fit reaches a client outside SecAgg+'s collect stage: Flower's ``secaggplus_mod`` keeps the protocol
    state in ``Context.state`` and, while it calls the client for the masked vector, that state's stage is still the
    key-sharing one (it stores the next stage after the fit). A client whose run-config turns SecAgg+ on answers any
    other fit with a refusal: a server that skipped the protocol would otherwise see one share, noised only for the
    sum (σ/√r of what one update alone needs)."""
    if context is None:
        return True
    state = context.state.config_records.get(RECORD_KEY_STATE)
    return state is None or state.get("current_stage") != Stage.SHARE_KEYS


def secagg_mod(msg: Message, ctxt: Context, call_next: Callable[[Message, Context], Message]) -> Message:
    """Flower's ``secaggplus_mod`` for SecAgg+ messages only (other strategies' fit messages pass through).

    A fit that does not contribute an update (a refusal) raises, so SecAgg+ treats the client as dropped.
    The bytes of the protocol's replies up to the masked vector (public keys, encrypted shares, the masked
    vector itself) are added to the fit metrics as ``secagg_uplink_bytes``; the unmask stage's shares
    (O(neighbours) × ~100 bytes) come after the fit reply and are not counted.
    """
    if msg.metadata.message_type != MessageType.TRAIN or RECORD_KEY_CONFIGS not in msg.content.config_records:
        return call_next(msg, ctxt)
    use_shamir(shamir.create_shares, shamir.combine_shares)  # the patches of Flower's SecAgg+ (fedapp.compat.secagg)
    use_key_agreement(key_agreement)
    use_masks(masks.pseudo_rand_gen)
    out = secaggplus_mod(msg, ctxt, _contribution_or_dropout(call_next))
    if out.has_error() or RECORD_KEY_CONFIGS not in out.content.config_records:
        return out
    sent = _record_bytes(out.content.config_records[RECORD_KEY_CONFIGS])
    counted: Mapping[str, Any] = ctxt.state.config_records.get(BYTES_KEY, {})
    so_far = int(counted.get("bytes", 0))
    if FIT_METRICS in out.content.config_records:  # the collect stage: the fit reply travels with the masked vector
        out.content.config_records[FIT_METRICS]["secagg_uplink_bytes"] = so_far + sent
        so_far, sent = 0, 0
    ctxt.state.config_records[BYTES_KEY] = ConfigRecord({"bytes": so_far + sent})
    return out


def _record_bytes(record: ConfigRecord) -> int:
    total = 0
    for value in record.values():
        items = value if isinstance(value, list) else [value]
        total += sum(len(v) if isinstance(v, (bytes, str)) else 8 for v in items)
    return total


class NoContribution(RuntimeError):
    """A sampled client does not contribute to this round's secure sum (SecAgg+ drops it)."""


def cohort_seen(ctxt: Context) -> int | None:
    """How many clients this client itself knows take part in the round's secure sum, from its SecAgg+ protocol state:
    the sample size the setup stage announced and, when every participant is its neighbour (``share_num`` ≥
    ``sample_num``: ``secagg-num-shares = 1.0``, the default), the public keys it received (its own included). None
    before the protocol has set up."""
    state: Mapping[str, Any] = ctxt.state.config_records.get(RECORD_KEY_STATE, {})
    sample, share, keys = state.get("sample_num"), state.get("share_num"), state.get("public_keys_dict:K")
    if isinstance(sample, bool) or not isinstance(sample, int) or sample < 1:
        return None
    if isinstance(share, int) and share >= sample and isinstance(keys, list) and keys:
        return min(sample, len(keys))
    return sample


def clamp_round_clients(msg: Message, ctxt: Context) -> None:
    """Cap the fit config's r_t (``dp-round-clients``, each client adds noise for a sum of r_t) at :func:`cohort_seen`:
    a server that announces more clients than the secure sum it set up would have every client add too little noise.
    A smaller r_t only adds noise."""
    config = msg.content.config_records.get(FIT_CONFIG)
    seen = cohort_seen(ctxt)
    if config is None or seen is None or CFG_ROUND_CLIENTS not in config:
        return
    claimed = config[CFG_ROUND_CLIENTS]
    if isinstance(claimed, int) and not isinstance(claimed, bool) and claimed > seen:
        config[CFG_ROUND_CLIENTS] = seen


def _contribution_or_dropout(call_next: Callable[[Message, Context], Message]) -> Callable[[Message, Context], Message]:
    def inner(msg: Message, ctxt: Context) -> Message:
        clamp_round_clients(msg, ctxt)
        out = call_next(msg, ctxt)
        if out.has_error():
            raise NoContribution(f"client error: {out.error}")
        fitres = recorddict_to_fitres(out.content, keep_input=True)
        metrics: dict[str, Any] = dict(fitres.metrics)
        if metrics.get("status", "ok") != "ok" or not fitres.parameters.tensors:
            raise NoContribution(f"client_id={metrics.get('client_id')} does not contribute: "
                                 f"{metrics.get('status')}: {metrics.get('reason')}")
        arrays = parameters_to_ndarrays(fitres.parameters)
        if not all(np.all(np.isfinite(a)) for a in arrays):
            # the quantizer maps NaN to its lowest level and shifts the whole modular sum: never mask one
            raise NoContribution(f"client_id={metrics.get('client_id')} does not contribute: its update is not "
                                 "finite and is never quantized")
        if SECAGG_BITS in metrics:
            fitres.parameters = _residue_payload(arrays, int(metrics[SECAGG_BITS]), ctxt)
            return Message(fitres_to_recorddict(fitres, keep_input=True), reply_to=msg)
        return out

    return inner


def _residue_payload(arrays: list[np.ndarray], bits: int, ctxt: Context) -> Any:
    """A discrete Gaussian share (residues modulo 2^b) as the values Flower's quantizer maps back onto the residues
    exactly (weight 1), after checking that the server set up exactly the field 2^b (:func:`ddg_transport`)."""
    expected = ddg_transport(bits)
    state: Mapping[str, Any] = ctxt.state.config_records.get(RECORD_KEY_STATE, {})
    got: dict[str, Any] = {k: state.get(flower_key) for k, flower_key in (("clipping_range", "clipping_range"),
                                                          ("quantization_range", "target_range"),
                                                          ("modulus_range", "mod_range"), ("max_weight", "max_weight"))}
    if any(not isinstance(got[k], (int, float)) or float(got[k]) != float(v) for k, v in expected.items()):
        raise NoContribution(f"the server's SecAgg+ parameters {got} are not the {bits}-bit field of the discrete "
                             f"Gaussian {expected}: the sum would reveal more than its residue modulo 2^{bits}")
    levels = expected["quantization_range"]
    if len(arrays) != 1 or not np.all((arrays[0] >= 0) & (arrays[0] < (1 << bits)) & (arrays[0] == np.floor(arrays[0]))):
        raise NoContribution(f"a discrete Gaussian share must be one array of residues modulo 2^{bits}")
    values = arrays[0].astype(np.float64) - levels / 2
    if not np.array_equal(quantize([values], levels / 2, levels)[0], arrays[0]):  # exact by construction
        raise NoContribution("Flower's quantizer does not reproduce the residues exactly")
    return ndarrays_to_parameters([values])


def run_with_secure_aggregation(grid: Grid, context: Context, strategy: Any, config: ServerConfig,
                                client_dp: ClientDPConfig, deployment: DeploymentConfig) -> None:
    """Flower's default workflow with SecAgg+ as the fit step (evaluation unchanged)."""
    use_shamir(shamir.create_shares, shamir.combine_shares)  # the patches of Flower's SecAgg+ (fedapp.compat.secagg)
    use_key_agreement(key_agreement)
    use_masks(masks.pseudo_rand_gen)
    shares = client_dp.secagg_num_shares
    workflow = DefaultWorkflow(fit_workflow=DPSecAggPlusWorkflow(
        strategy, num_shares=int(shares) if shares > 1 else shares,
        reconstruction_threshold=client_dp.secagg_threshold, max_weight=MAX_WEIGHT,
        timeout=deployment.round_timeout or None))
    workflow(grid, LegacyContext(context=context, config=config, strategy=strategy))
