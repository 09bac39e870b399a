"""NumPyClient of the DP2-FedSAM family (DP2-FedSAM Algorithm 2 and its Sec. 5 baselines).

Client-level DP (see ``strategies/dp2_fedsam.py``): each sampled client clips its update of the
*shared* parameters to C and adds N(0, C²σ²/r) (r clients per round) before sending it; σ is
calibrated by the Opacus accountant so that T = ``dp-rounds`` rounds at q = r/N spend ``target-epsilon``
(or given as ``noise-multiplier``; δ = ``client-delta``, 0 → N^-1.1; the paper's 1/N is passed explicitly). The accountant composes every round, sampled or not (that is where
amplification by sampling comes from), so after server round t every client has spent ε(t); a
client whose budget (its node-config ``epsilon``, else the planned ε(T)) the round would exceed refuses.

Personalized variants keep the head h_i in ``Context.state`` across rounds (initialized once from
the seeded model): τ_h epochs of SGD on h with φ fixed, then τ_φ epochs of SAM (or SGD for CENTAUR)
on φ with h fixed; only Δφ is sent. Evaluation uses (φ, h_i) on the local test split. FT variants
fine-tune a local copy of the global model for ``ft-epochs`` before evaluating; it never leaves.

Adaptive clipping (``adaptive-clip-quantile`` > 0; Andrew et al. 2021, Alg. 1 / Thm 1), as
:class:`~fedapp.clients.client_dp.ClientLevelDPClient` does it and with its functions: the clip is the server's C_t
(``dp-clip-norm``, :func:`~fedapp.clients.client_dp.adaptive_round`), the noise z_Δ·C_t/√r with z_Δ derived from
this client's own run-config, and the count share b_i − ½ + N(0, σ_b²/r) with b_i = 1[‖Δφ‖ ≤ C_t] on the shared-part
update it clips (:func:`~fedapp.clients.client_dp.release_count_share`): a metric without SecAgg+, one extra
coordinate of the secure sum under it.

The Gaussian noise draws from OS entropy unless ``seeded-noise`` is set: a server that knows the
run seed could otherwise regenerate and subtract it.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch
from flwr.client import NumPyClient
from flwr.common import ArrayRecord, Context

from fedapp.clients.client_dp import adaptive_setup, discrete_share, release_count_share
from fedapp.clients.client_level_guard import (
    ClientFloors,
    accounted_rounds,
    floor_refusal,
    record_release,
    releases,
    round_clients,
)
from fedapp.clients.common import (
    ClientSetup,
    evaluate_local_splits,
    model_for_shape,
    noise_rng,
    nonfinite_model_refusal,
    restart_if_diverged,
    round_lr,
    round_seed,
)
from fedapp.clients.training import (
    SAM,
    LocalTraining,
    TrainResult,
    epochs_to_steps,
    get_weights,
    local_train,
    set_weights,
)
from fedapp.config import ClientDPConfig, ConfigError, DataConfig, DP2FedSAMConfig
from fedapp.data.node_data import run_shape
from fedapp.models.catalog import ModelSpec
from fedapp.privacy.profiles import client_level_mechanism, secure_sum_mechanism
from fedapp.privacy.secure_aggregation import OUTSIDE_SECAGG, SECAGG_BITS, outside_secagg
from strategies.aggregate import flatten, unflatten
from strategies.dp2_fedsam import Variant, shared_mask
from strategies.privacy.adaptive_clipping import AdaptiveClipConfig
from strategies.privacy.budget import budget_refusal
from strategies.privacy.mechanisms import ClientLevelDP, cached_epsilon, clip_by_l2

HEAD_KEY = "dp2-head"


def run_model(data: DataConfig, model_spec: ModelSpec) -> torch.nn.Module:
    """The run's (seeded) model, built from the dataset's shapes (the run-config schema for node-local data)."""
    return model_for_shape(model_spec, *run_shape(data))


def shared_weights(head: str, data: DataConfig, model_spec: ModelSpec, weights: list[np.ndarray],
                   personalized: bool) -> list[np.ndarray]:
    """The arrays of ``weights`` the server holds: φ only (personalized variants) or all; ``head`` is the run-config
    ``dp2-head``."""
    try:
        mask = shared_mask(run_model(data, model_spec), head, personalized)
    except ValueError as exc:
        raise ConfigError(f"run-config 'dp2-head' = {head!r}: {exc}") from None
    if len(mask) != len(weights):
        raise ValueError(f"model has {len(mask)} arrays, got {len(weights)} initial weights")
    return [w for w, m in zip(weights, mask) if m]


class DP2FedSAMClient(NumPyClient):
    """Local update + clip + noise of one client; for personalized variants also the keeper of h_i."""

    #: an audit canary's unit direction u (or zero) over the shared coordinates (:mod:`fedapp.privacy.audit`): the
    #: client then sends C·u through the mechanism instead of training, keeps its head and evaluates nothing
    canary: np.ndarray | None = None

    def __init__(self, setup: ClientSetup, client_dp: ClientDPConfig, dp2_fedsam: DP2FedSAMConfig, context: Context,
                 variant: Variant) -> None:
        self.s = setup
        self.client_dp = client_dp  # the run-config's client-level DP section
        self.dp2 = dp2_fedsam  # the run-config's DP2-FedSAM section
        self.context = context
        self.variant = variant
        model = setup.new_model()
        self.names = list(model.state_dict().keys())
        try:
            self.mask = shared_mask(model, dp2_fedsam.dp2_head, variant.personalized)
        except ValueError as exc:
            raise ConfigError(f"run-config 'dp2-head' = {dp2_fedsam.dp2_head!r}: {exc}") from None
        self.initial = get_weights(model)
        self.shared_names = [n for n, m in zip(self.names, self.mask) if m]
        self.head_names = [n for n, m in zip(self.names, self.mask) if not m]
        self.shared_shapes = [w.shape for w, m in zip(self.initial, self.mask) if m]

    # ---- state -----------------------------------------------------------------------
    def head(self) -> list[np.ndarray]:
        """h_i: from ``Context.state`` once trained, else the seeded initial head (Alg. 2 input h_i⁰)."""
        if HEAD_KEY in self.context.state:
            record = self.context.state.array_records[HEAD_KEY]
            return record.to_numpy_ndarrays()
        return [w for w, m in zip(self.initial, self.mask) if not m]

    def save_head(self, head: list[np.ndarray]) -> None:
        self.context.state[HEAD_KEY] = ArrayRecord(numpy_ndarrays=[np.asarray(h, dtype=np.float32) for h in head])

    def budget(self, planned: float) -> float:
        """Node-config ``epsilon`` when given, else the mechanism's planned ε after T = dp-rounds rounds."""
        node = self.context.node_config
        return float(node["epsilon"]) if "epsilon" in node else planned

    def full_weights(self, shared: list[np.ndarray]) -> list[np.ndarray]:
        if len(shared) != len(self.shared_shapes):
            raise ValueError(f"server sent {len(shared)} arrays, the shared model has {len(self.shared_shapes)}")
        it_s, it_h = iter(shared), iter(self.head())
        return [next(it_s) if m else next(it_h) for m in self.mask]

    # ---- Flower API ----------------------------------------------------------------------
    def get_parameters(self, config: dict[str, Any]) -> list[np.ndarray]:
        return [w for w, m in zip(self.initial, self.mask) if m]

    def fit(self, parameters: list[np.ndarray], config: dict[str, Any]):
        p, training = self.s.profile, self.s.training
        rnd = int(config["server-round"])
        n_train = len(self.s.train)
        metrics: dict[str, Any] = {"client_id": p.client_id, "batch_size": p.batch_size, "num_train": n_train}
        if n_train == 0:
            return [], 0, {**metrics, "status": "refused", "reason": "empty local training set"}
        dp = client_level_mechanism(self.s.general, training, self.client_dp, p.num_clients)
        if self.client_dp.secure_aggregation and outside_secagg(self.context):
            return [], 0, {**metrics, "status": "refused", "reason": OUTSIDE_SECAGG}
        floors = ClientFloors.from_node_config(self.context.node_config)
        budget = self.budget(cached_epsilon(dp, dp.rounds))
        rounds = accounted_rounds(rnd, releases(self.context))  # never fewer than its own releases + 1
        eps_now, eps_next = cached_epsilon(dp, rounds - 1), cached_epsilon(dp, rounds)
        metrics.update({"noise_multiplier": dp.noise_multiplier, "sample_rate": dp.sample_rate, "delta": dp.delta,
                        "epsilon_budget": budget, "reported_epsilon": budget, "steps": rounds - 1})
        reason = budget_refusal(rounds, eps_next, budget, f"client-level, sigma={dp.noise_multiplier:.4f}, "
                                f"q={dp.sample_rate:.4f}, planned T={dp.rounds}") or floor_refusal(dp, floors)
        # the mechanism the update carries (under adaptive clipping: C_t, z_Δ)
        noise_dp: ClientLevelDP | None = dp
        adaptive: AdaptiveClipConfig | None = None
        if reason is None:
            noise_dp, adaptive, reason = adaptive_setup(dp, self.client_dp, config, metrics)
        reason = reason or nonfinite_model_refusal(parameters)
        if reason is not None:
            return [], 0, {**metrics, "status": "refused", "epsilon_spent": eps_now, "reason": reason}
        assert noise_dp is not None  # adaptive_setup gives no mechanism only with a reason
        start = time.perf_counter()
        lr = round_lr(training.lr, training.lr_decay, rnd)
        head: list[np.ndarray] = []
        if self.canary is not None:  # C·u on the shared coordinates; no data read, the head untouched
            delta, diverged = float(training.clip_norm) * self.canary, False
            res = TrainResult(steps=0, loss=float("nan"), seconds=0.0)
        else:
            delta, diverged, head, res = self.local_update(parameters, rnd)
        rng = noise_rng(self.s.general, p.client_id, rnd, self.context.node_config)
        r_t = round_clients(config, dp, floors)
        ddg = secure_sum_mechanism(self.client_dp, dp, delta.size)  # never with adaptive clipping (adaptive_round)
        try:
            if ddg is None:  # Alg. 2 lines 18–19: clip, add N(0, C²σ²/r_t) (adaptive: C_t, z_Δ)
                noisy, norm = noise_dp.privatize(delta, rng, r_t)
                arrays = unflatten(noisy, self.shared_shapes)
            else:  # clip, then the discrete Gaussian share of the secure sum
                clipped, norm = clip_by_l2(delta, dp.clip)
                arrays = discrete_share(ddg, clipped, config, r_t, rng)
                metrics[SECAGG_BITS] = ddg.bits
        except ValueError as exc:  # malformed round config from the server: send nothing
            return [], 0, {**metrics, "status": "refused", "reason": f"bad round config from server: {exc}"}
        if adaptive is not None:  # the bit of ‖Δφ‖, the shared-part update just clipped at C_t (never the head's)
            arrays = release_count_share(arrays, metrics, norm, noise_dp, adaptive, config, floors, rng)
        record_release(self.context)
        if self.variant.personalized and not diverged and self.canary is None:  # a diverged round keeps the head
            self.save_head(head)  # Alg. 2 line 10: h_i^{t+1} stays here
        metrics.update({"status": "ok", "epsilon_spent": eps_next, "steps": rounds, "lr": lr,  # no train loss: not private
                        "steps_round": res.steps, "train_seconds": time.perf_counter() - start})
        if self.dp2.dp2_report_norms:  # NOT privatized: a diagnostic (Fig. 5) that leaks ‖Δ_i‖ to the server
            metrics["local_update_norm"] = norm
        # under secure aggregation every update has weight 1: the secure sum is Σ Δ_i (and N_i stays private)
        return arrays, 1 if self.client_dp.secure_aggregation else n_train, metrics

    def local_update(self, parameters: list[np.ndarray],
                     rnd: int) -> tuple[np.ndarray, bool, list[np.ndarray], TrainResult]:
        """(Δφ flat, diverged, the trained head, the shared part's result) of one round's local training (Alg. 2
        lines 5-17)."""
        p, training = self.s.profile, self.s.training
        n_train = len(self.s.train)
        model = self.s.new_model()
        set_weights(model, self.full_weights(parameters))
        lr = round_lr(training.lr, training.lr_decay, rnd)
        lr_h = round_lr(self.dp2.dp2_lr_head, training.lr_decay, rnd)
        seed, mom = round_seed(self.s.general.seed, p.client_id, rnd), training.momentum
        sam = SAM(self.dp2.sam_rho, self.dp2.sam_adaptive, self.dp2.sam_eta) if self.variant.sam else None

        def spec(names: list[str], epochs: int, rate: float, seed: int, sam: SAM | None = None) -> LocalTraining:
            return LocalTraining(batch_size=p.batch_size, steps=epochs_to_steps(n_train, p.batch_size, epochs),
                                 lr=rate, momentum=mom, seed=seed, trainable=tuple(names), sam=sam)

        if self.variant.personalized:  # Alg. 2 lines 5–16: head h with φ fixed, then φ with h fixed
            local_train(model, self.s.train, spec(self.head_names, self.dp2.dp2_tau_h, lr_h, seed), self.s.device)
            res = local_train(model, self.s.train, spec(self.shared_names, self.dp2.dp2_tau_phi, lr, seed + 1, sam),
                              self.s.device)
        else:  # DP-FedSAM / DP-FedAvg local training on the full model
            res = local_train(model, self.s.train, spec(self.shared_names, p.local_epochs, lr, seed, sam),
                              self.s.device)
        new = get_weights(model)
        delta = flatten([w for w, m in zip(new, self.mask) if m]) - flatten(parameters)
        delta, diverged = restart_if_diverged(delta, p.client_id, rnd)
        head = [w for w, m in zip(new, self.mask) if not m]
        diverged = diverged or not all(np.all(np.isfinite(h)) for h in head)
        return delta, diverged, head, res

    def evaluate(self, parameters: list[np.ndarray], config: dict[str, Any]):
        training, cid = self.s.training, self.s.profile.client_id
        if self.canary is not None:  # a canary has no data: it never counts in utility metrics
            return 0.0, 0, {"client_id": cid, "audit_canary": True}
        if len(self.s.test) == 0 and (self.s.validation is None or len(self.s.validation) == 0):
            return 0.0, 0, {"client_id": cid}
        model = self.s.new_model()
        set_weights(model, self.full_weights(parameters))
        if self.variant.finetune and self.dp2.ft_epochs > 0 and len(self.s.train) > 0:
            rnd, b = int(config.get("server-round", 1)), self.s.profile.batch_size
            local_train(model, self.s.train, LocalTraining(
                batch_size=b, steps=epochs_to_steps(len(self.s.train), b, self.dp2.ft_epochs), lr=round_lr(training.lr, training.lr_decay, rnd),
                momentum=training.momentum, seed=round_seed(self.s.general.seed, cid, rnd, stream=612)), self.s.device)
        return evaluate_local_splits(self.s, model)
