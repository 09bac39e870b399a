"""Fed-SMP (Hu, Guo & Gong, "Federated Learning with Sparsified Model Perturbation") and DP-FedAvg.

What it protects: *client-level* DP — the participation and whole dataset of one client — with
the noise added *locally* by each client (N(0, C²σ²/r) per coordinate, Alg. 1 line 22 /
Alg. 2 line 51) so that the **sum** of the r sampled updates carries N(0, C²σ²) on every
transmitted coordinate. The reported ε (subsampled Gaussian, q = r/n, T rounds, Opacus RDP
accountant; Theorem 1) is the guarantee of that sum, i.e. against an honest-but-curious
server that only sees the aggregate, which assumes secure aggregation (Alg. 1 line 23). This
implementation does *not* run secure aggregation: a server that reads each update alone gets
only the much weaker per-update guarantee (noise multiplier σ/√r), recorded as
``epsilon_individual`` so nobody mistakes one for the other.

Who accounts: client-level ε is a property of the mechanism (σ, q = r/n, T, δ), not of a
client's data, and it accrues every round for every client (sampled or not: amplification
by subsampling is what the accountant composes). The server therefore computes the ledger
and writes ε after round t into every client record's ``epsilon_spent``; each client
computes the same value from the same run-config and refuses to train in a round that would
exceed the budget ε(T) (``status = "refused"``).

Registry strategies (all share :class:`ClientLevelStrategy`):

* ``dp-fedavg``      Alg. 1: clip the dense update to C, add N(0, C²σ²/r), server averages with 1/r.
* ``fed-smp-randk``  Alg. 2 with rand_k: the server draws k = p·d coordinates from a seed and sends
                     the *seed*; clients scale by d/k, clip, add noise on the k coordinates only.
* ``fed-smp-topk``   Alg. 2 with top_k: the server runs τ_p SGD steps on a public set D_p held out of
                     every client's data and sends the k largest |Δ_p| coordinates; no d/k scaling.
* ``fedavg-randk`` / ``fedavg-topk``  the same sparsify + clip without noise (σ = 0): non-private
                     baselines that differ from Fed-SMP only in the DP noise (paper Sec. 6.3.2).

Wire format of a sparse update: a single float32 array of the k kept values in mask order
(ascending coordinate index) — no zeros and no index list; the server knows the mask.
Sign convention: this library's Δ is θ_local − θ (the paper's is θ − θ_local), so the server
step θ ← θ + (1/r) Σ Δ_i is the paper's θ ← θ − (1/r) Σ y_i.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from logging import WARNING
from typing import Any

import numpy as np
from flwr.common import FitRes, Scalar, log, parameters_to_ndarrays
from flwr.server.client_manager import ClientManager
from flwr.server.client_proxy import ClientProxy

from strategies.aggregate import flatten
from strategies.base import ClientUpdate, DPFLStrategy, RejectedUpdate, StrategyContext, common_kwargs
from strategies.client_dp import ClientLevelDP, cached_epsilon, clip_by_l2, mechanism_from_config

SPARSIFIERS = ("none", "randk", "topk")
#: fit-config keys of the round's mask (sent with the global model)
CFG_SPARSIFIER, CFG_K, CFG_SEED, CFG_MASK = "smp-sparsifier", "smp-k", "smp-mask-seed", "smp-mask"
CFG_SIGMA = "dp-noise-multiplier"


# ---------------------------------------------------------------------------- masks (framework-free)
def num_kept(num_params: int, ratio: float) -> int:
    """k = round(p·d), at least 1 and at most d."""
    if not 0 < ratio <= 1:
        raise ValueError(f"compression ratio p must be in (0, 1], got {ratio}")
    return int(min(num_params, max(1, round(ratio * num_params))))


def mask_seed(run_seed: int, server_round: int, stream: int = 501) -> int:
    """The rand-k seed of a round (server side; sent to clients instead of the mask)."""
    return int(np.random.SeedSequence([int(run_seed), stream, int(server_round)]).generate_state(1)[0] & 0x7FFFFFFF)


def rand_k_indices(num_params: int, k: int, seed: int) -> np.ndarray:
    """SelectRandk (Alg. 2 line 21): k distinct coordinates of [d] drawn uniformly from ``seed``, ascending."""
    if not 1 <= k <= num_params:
        raise ValueError(f"k = {k} must be in 1..d = {num_params}")
    rng = np.random.default_rng(int(seed))
    return np.sort(rng.choice(num_params, size=k, replace=False)).astype(np.int64)


def top_k_indices(scores: np.ndarray, k: int) -> np.ndarray:
    """SelectTopk (Alg. 2 line 32): the k coordinates with the largest |scores|, ascending."""
    scores = np.abs(np.asarray(scores, dtype=np.float64).ravel())
    if not 1 <= k <= scores.size:
        raise ValueError(f"k = {k} must be in 1..d = {scores.size}")
    if k == scores.size:
        return np.arange(k, dtype=np.int64)
    # stable tie-breaking: larger |score| first, then lower index
    order = np.lexsort((np.arange(scores.size), -scores))
    return np.sort(order[:k]).astype(np.int64)


def check_indices(indices: np.ndarray, num_params: int) -> np.ndarray:
    """Validate a mask received from the server: 1-d, strictly ascending, inside [0, d)."""
    idx = np.asarray(indices)
    if idx.ndim != 1 or idx.size == 0 or idx.dtype.kind not in "iu":
        raise ValueError(f"mask must be a non-empty 1-d integer array, got shape {idx.shape} dtype {idx.dtype}")
    if idx[0] < 0 or idx[-1] >= num_params or (idx.size > 1 and np.any(np.diff(idx) <= 0)):
        raise ValueError(f"mask indices must be strictly ascending in [0, {num_params})")
    return idx.astype(np.int64)


# ---------------------------------------------------------------------------- client math (Alg. 2 DP-spar)
def dp_spar(update: np.ndarray, indices: np.ndarray, sparsifier: str, *, clip: float | None,
            dp: ClientLevelDP | None, rng: np.random.Generator) -> tuple[np.ndarray, float]:
    """DP-spar (Alg. 2 lines 44–51) returning only the k transmitted values (mask order) and the pre-clip norm.

    rand_k: Δ' = (d/k) Δ⊙m (unbiased); top_k: Δ' = Δ⊙m. Then Δ̂ = Δ'·min(1, C/‖Δ'‖) and, if ``dp``
    is given, N(0, C²σ²/r) on the k masked coordinates only (the others are never sent).
    ``dp=None`` (FedAvg-randk/topk) clips to ``clip`` (if not None) and adds no noise.
    """
    if sparsifier not in ("randk", "topk"):
        raise ValueError(f"sparsifier must be 'randk' or 'topk', got {sparsifier!r}")
    flat = np.asarray(update, dtype=np.float64).ravel()
    values = flat[indices]
    if sparsifier == "randk":
        values = values * (flat.size / len(indices))
    if dp is not None:
        return dp.privatize(values, rng)
    if clip is None:
        return values, float(np.linalg.norm(values))
    return clip_by_l2(values, clip)


def dp_dense(update: np.ndarray, *, clip: float | None, dp: ClientLevelDP | None,
             rng: np.random.Generator) -> tuple[np.ndarray, float]:
    """Alg. 1 lines 21–22: clip the whole update to C and add N(0, C²σ²/r) on all d coordinates."""
    flat = np.asarray(update, dtype=np.float64).ravel()
    if dp is not None:
        return dp.privatize(flat, rng)
    if clip is None:
        return flat, float(np.linalg.norm(flat))
    return clip_by_l2(flat, clip)


def encode_sparse(values: np.ndarray) -> list[np.ndarray]:
    """Wire payload: one float32 array of the k values in mask order (≈ 4k bytes + the .npy header)."""
    return [np.ascontiguousarray(values, dtype=np.float32).ravel()]


def decode_sparse(arrays: list[np.ndarray], indices: np.ndarray, num_params: int) -> np.ndarray:
    """Inverse of :func:`encode_sparse`: the dense float64 update with zeros off the mask; raises ValueError."""
    if len(arrays) != 1:
        raise ValueError(f"sparse payload must be exactly 1 array, got {len(arrays)}")
    values = np.asarray(arrays[0])
    if values.dtype.name not in ("float32", "float64"):
        raise ValueError(f"sparse payload has dtype {values.dtype}, expected float32 or float64")
    if values.shape != (len(indices),):
        raise ValueError(f"sparse payload has shape {values.shape}, expected ({len(indices)},) for k = {len(indices)}")
    dense = np.zeros(num_params, dtype=np.float64)
    dense[indices] = values
    return dense


def mask_from_config(config: Mapping[str, Scalar], num_params: int) -> tuple[str, np.ndarray | None]:
    """Client side: (sparsifier, mask indices) from the round's fit config; ('none', None) for dense."""
    sparsifier = str(config.get(CFG_SPARSIFIER, "none"))
    if sparsifier == "none":
        return sparsifier, None
    if sparsifier == "randk":
        k = int(config[CFG_K])
        return sparsifier, rand_k_indices(num_params, k, int(config[CFG_SEED]))
    if sparsifier == "topk":
        raw = config[CFG_MASK]
        if not isinstance(raw, bytes):
            raise ValueError(f"fit config {CFG_MASK!r} must be bytes, got {type(raw).__name__}")
        idx = check_indices(np.frombuffer(raw, dtype="<i4"), num_params)
        if CFG_K in config and int(config[CFG_K]) != len(idx):
            raise ValueError(f"mask has {len(idx)} indices but {CFG_K} = {config[CFG_K]}")
        return sparsifier, idx
    raise ValueError(f"unknown sparsifier {sparsifier!r} in fit config; valid: {SPARSIFIERS}")


# ---------------------------------------------------------------------------- server strategy
PublicUpdateFn = Callable[[list[np.ndarray], int], np.ndarray]


class ClientLevelStrategy(DPFLStrategy):
    """DP-FedAvg / Fed-SMP / FedAvg-randk/topk server: round mask, 1/r aggregation, client-level ε ledger."""

    name = "dp-fedavg"
    privacy = ("client-level DP, noise added locally by each client (C·σ/√r); ε is for the sum "
               "(honest-but-curious server behind secure aggregation, not simulated)")

    def __init__(self, *, sparsifier: str = "none", compression_ratio: float = 1.0, private: bool = True,
                 clip: float | None = None, dp_factory: Callable[[int], ClientLevelDP] | None = None,
                 public_update_fn: PublicUpdateFn | None = None, **kwargs: Any) -> None:
        prevalidate = kwargs.pop("prevalidate", None)
        super().__init__(prevalidate=self._prevalidate, **kwargs)
        if sparsifier not in SPARSIFIERS:
            raise ValueError(f"sparsifier must be one of {SPARSIFIERS}, got {sparsifier!r}")
        if sparsifier == "topk" and public_update_fn is None:
            raise ValueError("top-k needs a public update function (server-side SGD on D_p)")
        if private and dp_factory is None:
            raise ValueError("a private strategy needs a dp_factory (client-level mechanism)")
        self.sparsifier = sparsifier
        self.k = self.num_params if sparsifier == "none" else num_kept(self.num_params, compression_ratio)
        self.private = private
        self.clip = clip
        self.dp_factory = dp_factory
        self.public_update_fn = public_update_fn
        self.user_prevalidate = prevalidate
        self.dp: ClientLevelDP | None = None
        self.masks: dict[int, np.ndarray] = {}
        self.sampled: dict[int, int] = {}
        self.uplink_total = 0

    # ---- setup before round 1 (before any training / results folder)
    def _prevalidate(self, num_clients: int) -> None:
        if self.user_prevalidate is not None:
            self.user_prevalidate(num_clients)
        self.setup_privacy(num_clients)

    def setup_privacy(self, num_clients: int) -> None:
        if self.private and self.dp is None:
            self.dp = self.dp_factory(num_clients)  # type: ignore[misc]

    # ---- hooks
    def sample_clients(self, server_round: int, client_manager: ClientManager) -> list[ClientProxy]:
        nodes = super().sample_clients(server_round, client_manager)
        self.sampled[server_round] = len(nodes)
        return nodes

    def round_mask(self, server_round: int) -> np.ndarray | None:
        """m_t of the round (cached): rand-k from the round seed, top-k from Δ_p on the public set."""
        if self.sparsifier == "none":
            return None
        if server_round not in self.masks:
            if self.sparsifier == "randk":
                idx = rand_k_indices(self.num_params, self.k, mask_seed(self.seed, server_round))
            else:
                delta_p = np.asarray(self.public_update_fn(self.current_weights, server_round)).ravel()  # type: ignore[misc]
                if delta_p.shape != (self.num_params,) or not np.all(np.isfinite(delta_p)):
                    raise RuntimeError(f"round {server_round}: public update is not a finite vector of {self.num_params}")
                idx = top_k_indices(delta_p, self.k)
            self.masks = {server_round: idx}  # keep only the current round's mask
        return self.masks[server_round]

    def fit_config(self, server_round: int) -> dict[str, Scalar]:
        self.setup_privacy(self.num_available)
        cfg: dict[str, Scalar] = {CFG_SPARSIFIER: self.sparsifier}
        if self.dp is not None:
            cfg[CFG_SIGMA] = float(self.dp.noise_multiplier)
        if self.sparsifier == "randk":
            cfg.update({CFG_K: self.k, CFG_SEED: mask_seed(self.seed, server_round)})
            self.round_mask(server_round)
        elif self.sparsifier == "topk":
            idx = self.round_mask(server_round)
            cfg.update({CFG_K: self.k, CFG_MASK: np.asarray(idx, dtype="<i4").tobytes()})
        return cfg

    def decode_update(self, server_round: int, res: FitRes, metrics: Mapping[str, Scalar]) -> np.ndarray:
        if self.dp is not None:
            reported = metrics.get("noise_multiplier")
            if reported is None or not math.isclose(float(reported), self.dp.noise_multiplier, rel_tol=1e-9):
                raise RejectedUpdate(f"client noise multiplier {reported!r} != mechanism σ = {self.dp.noise_multiplier}")
        if self.sparsifier == "none":
            return super().decode_update(server_round, res, metrics)
        try:
            return decode_sparse(parameters_to_ndarrays(res.parameters), self.round_mask(server_round), self.num_params)
        except ValueError as exc:
            raise RejectedUpdate(str(exc)) from None

    @property
    def max_update_norm(self) -> float | None:  # type: ignore[override]
        """Declared bound checked by ``DPFLStrategy.validate_update``: ‖Δ̂‖ ≤ C, plus, when private, the
        noise norm C·σ/√r·√k with a 12-std allowance (a legitimate update exceeds it with negligible probability)."""
        if self.dp is not None:
            s = self.dp.per_client_std
            return self.dp.clip + s * (math.sqrt(self.k) + 12.0)
        return None if self.clip is None else self.clip * (1 + 1e-5)

    def aggregation_weights(self, server_round: int, updates: list[ClientUpdate]) -> tuple[np.ndarray, dict[str, Any]]:
        r = self.sampled.get(server_round, len(updates))
        if len(updates) < r:
            log(WARNING, "round %d: %d of %d sampled clients contributed; the sum carries less noise than σ "
                "assumes", server_round, len(updates), r)
        round_bytes = int(sum(u.uplink_bytes for u in updates))
        self.uplink_total += round_bytes
        extra: dict[str, Any] = {
            "clients_sampled": r, "compression_ratio": self.k / self.num_params, "k": self.k,
            "uplink_bytes_cumulative": self.uplink_total,
            "uplink_bytes_per_client": round_bytes / max(len(updates), 1),
        }
        if self.dp is not None:
            extra.update({"epsilon": cached_epsilon(self.dp, min(server_round, self.dp.rounds)), "delta": self.dp.delta,
                          "noise_multiplier": self.dp.noise_multiplier, "sample_rate": self.dp.sample_rate,
                          "epsilon_individual": self.dp.epsilon_individual(min(server_round, self.dp.rounds))})
        return np.ones(len(updates)), extra

    def aggregate_updates(self, server_round: int, updates: list[ClientUpdate], weights: np.ndarray) -> np.ndarray:
        """(1/r) Σ_i Δ_i over the r *sampled* clients (Alg. 1 line 10, Alg. 2 line 16)."""
        r = max(self.sampled.get(server_round, len(updates)), 1)
        return np.sum([u.update for u in updates], axis=0) / r

    def _base_record(self, proxy: ClientProxy, res: FitRes, metrics: Mapping[str, Scalar]) -> dict[str, Any]:
        rec = super()._base_record(proxy, res, metrics)
        if self.dp is not None:  # the server's ledger is authoritative (see module docstring)
            # rounds past the planned T release nothing (clients refuse), so the ledger stops at ε(T)
            rnd = min(int(self._pending["round"]) if self._pending is not None else 0, self.dp.rounds)
            rec.update(epsilon_spent=cached_epsilon(self.dp, rnd), epsilon_budget=cached_epsilon(self.dp, None),
                       delta=self.dp.delta, noise_multiplier=self.dp.noise_multiplier,
                       sample_rate=self.dp.sample_rate)
        return rec


# ---------------------------------------------------------------------------- factories
def _public_update_fn(cfg: Mapping[str, Any]) -> PublicUpdateFn:
    """Server-side τ_p momentum-SGD steps on D_p from θ_t (the clients' optimizer, Sec. 6.2); returns Δ_p."""
    from fedapp.client_data import public_dataset
    from fedapp.clients.client_dp import local_steps, train_local_steps
    from fedapp.clients.common import make_model, round_lr
    from fedapp.config import ConfigError
    from fedapp.training import get_weights, resolve_device, set_weights

    if int(cfg["public-samples"]) <= 0:
        raise ConfigError(f"strategy {cfg['strategy']!r} needs run-config 'public-samples' > 0 (the server's "
                          f"public set D_p), got {cfg['public-samples']}")
    public = public_dataset(cfg)  # type: ignore[arg-type]
    batch = int(cfg["batch-size"]) or 10
    if batch > len(public):
        raise ConfigError(f"run-config 'public-samples' = {len(public)} is smaller than the batch size {batch}")
    steps = int(cfg["public-steps"]) or local_steps(cfg, len(public), batch)  # type: ignore[arg-type]
    model = make_model(cfg, public)  # type: ignore[arg-type]
    device = resolve_device(cfg["device"])

    def update(weights: list[np.ndarray], server_round: int) -> np.ndarray:
        set_weights(model, weights)
        train_local_steps(model, public, batch_size=batch, steps=steps, lr=round_lr(cfg, server_round),  # type: ignore[arg-type]
                          momentum=float(cfg["momentum"]), device=device, seed=mask_seed(int(cfg["seed"]), server_round, 502))
        return flatten(get_weights(model)) - flatten(weights)

    return update


def _build(cfg: Mapping[str, Any], ctx: StrategyContext, *, name: str, sparsifier: str, private: bool) -> ClientLevelStrategy:
    kwargs = common_kwargs(cfg, ctx)
    strategy = ClientLevelStrategy(
        sparsifier=sparsifier, compression_ratio=float(cfg["compression-ratio"]) if sparsifier != "none" else 1.0,
        private=private, clip=float(cfg["clip-norm"]),
        dp_factory=(lambda n: mechanism_from_config(cfg, int(cfg["num-clients"]) or n)) if private else None,
        public_update_fn=_public_update_fn(cfg) if sparsifier == "topk" else None, **kwargs)
    strategy.name = name
    if not private:
        strategy.privacy = "none: non-private baseline (sparsified + clipped updates, no noise)"
    return strategy


def build_dp_fedavg(cfg: Mapping[str, Any], ctx: StrategyContext) -> ClientLevelStrategy:
    return _build(cfg, ctx, name="dp-fedavg", sparsifier="none", private=True)


def build_fed_smp_randk(cfg: Mapping[str, Any], ctx: StrategyContext) -> ClientLevelStrategy:
    return _build(cfg, ctx, name="fed-smp-randk", sparsifier="randk", private=True)


def build_fed_smp_topk(cfg: Mapping[str, Any], ctx: StrategyContext) -> ClientLevelStrategy:
    return _build(cfg, ctx, name="fed-smp-topk", sparsifier="topk", private=True)


def build_fedavg_randk(cfg: Mapping[str, Any], ctx: StrategyContext) -> ClientLevelStrategy:
    return _build(cfg, ctx, name="fedavg-randk", sparsifier="randk", private=False)


def build_fedavg_topk(cfg: Mapping[str, Any], ctx: StrategyContext) -> ClientLevelStrategy:
    return _build(cfg, ctx, name="fedavg-topk", sparsifier="topk", private=False)
