"""Typed settings a user's ServerApp and ClientApp must agree on (build both sides from the same object)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

ACCOUNTANTS = ("rdp", "prv")
RECORD_NEIGHBOURS = ("replace-one", "add-remove")


@dataclass(frozen=True)
class DPSGDSettings:
    """Record-level DP-SGD shared by the server's update checks and every client's training.

    ``rounds`` is T, the rounds each client's (ε_i, δ_i) budget is planned for: a client calibrates its noise so that
    T rounds of ``local_epochs``·⌈N_i/b_i⌉ Poisson-sampled steps spend exactly ε_i, and refuses any round past that.
    ``clip_norm`` is the per-sample clip c; the learning rate of round t is ``lr``·``lr_decay``^(t−1). The server uses
    c, the schedule and ``momentum`` to bound an honest update (DP-FedAvg) and to know the noise variance it must carry
    (Robust-HDP), so they must be the clients' values."""

    rounds: int
    clip_norm: float = 1.0
    lr: float = 0.05
    momentum: float = 0.0
    lr_decay: float = 1.0
    local_epochs: int = 1
    accountant: str = "rdp"
    record_neighbours: str = "replace-one"

    def __post_init__(self) -> None:
        problems = []
        if self.rounds < 1:
            problems.append(f"rounds = {self.rounds} must be >= 1")
        if not (math.isfinite(self.clip_norm) and self.clip_norm > 0):
            problems.append(f"clip_norm = {self.clip_norm} must be a finite number > 0")
        if not (math.isfinite(self.lr) and self.lr > 0):
            problems.append(f"lr = {self.lr} must be a finite number > 0")
        if not 0 <= self.momentum < 1:
            problems.append(f"momentum = {self.momentum} must be in [0, 1)")
        if not 0 < self.lr_decay <= 1:
            problems.append(f"lr_decay = {self.lr_decay} must be in (0, 1]")
        if self.local_epochs < 1:
            problems.append(f"local_epochs = {self.local_epochs} must be >= 1")
        if self.accountant not in ACCOUNTANTS:
            problems.append(f"accountant = {self.accountant!r} must be one of {ACCOUNTANTS}")
        if self.record_neighbours not in RECORD_NEIGHBOURS:
            problems.append(f"record_neighbours = {self.record_neighbours!r} must be one of {RECORD_NEIGHBOURS}")
        if problems:
            raise ValueError("DPSGDSettings: " + "; ".join(problems))

    def lr_schedule(self) -> Callable[[int], float]:
        """η_t = lr · lr_decay^(t−1), the step size of round t (server and clients)."""
        lr, decay = self.lr, self.lr_decay
        return lambda server_round: lr * decay ** (server_round - 1)


@dataclass(frozen=True)
class Rounds:
    """The round settings every strategy shares (:class:`strategies.engine.RoundEngine`'s arguments).

    ``clients_per_round`` r: 0 = every connected client each round (a record-level strategy samples r of them; a
    client-level strategy samples each client with q = r/n, secret Poisson sampling). ``client_sizes``: every client's
    number of training records by client id, when the server knows them; without it the server cannot bound the
    ``num_examples`` a client claims (FedAvg and DP-FedAvg weights are proportional to it)."""

    num_rounds: int
    min_available_clients: int = 2
    clients_per_round: int = 0
    fraction_evaluate: float = 1.0
    evaluate_every: int = 1
    server_lr: float = 1.0
    seed: int = 0
    strike_limit: int = 3
    robust_norm_factor: float = 10.0
    client_sizes: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        problems = []
        if self.num_rounds < 1:
            problems.append(f"num_rounds = {self.num_rounds} must be >= 1")
        if self.min_available_clients < 2:
            problems.append(f"min_available_clients = {self.min_available_clients} must be >= 2")
        if self.clients_per_round < 0:
            problems.append(f"clients_per_round = {self.clients_per_round} must be >= 0")
        if not 0 <= self.fraction_evaluate <= 1:
            problems.append(f"fraction_evaluate = {self.fraction_evaluate} must be in [0, 1]")
        if not self.server_lr > 0:
            problems.append(f"server_lr = {self.server_lr} must be > 0")
        if problems:
            raise ValueError("Rounds: " + "; ".join(problems))


@dataclass(frozen=True)
class SoteriaFLSettings:
    """SoteriaFL (Li et al. 2022) shared by the server and every client: the method (``soteriafl-sgd``,
    ``soteriafl-gd``, ``soteriafl-svrg``, ``soteriafl-saga``, ``cdp-sgd``, ``ldp-sgd``, ``ldp-svrg``), T = ``rounds``
    the clients' (ε_i, δ_i) are planned for, the per-sample clip G = ``clip_norm``, the server step η = ``eta``, the
    random-k ``k`` (0: ⌊d/20⌋) and shift step ``gamma`` (0: Theorem 3's value), the minibatch ``batch_size`` (0: the
    paper's corollary rule) and SVRG's snapshot probability (0: b/m). Server and clients derive k and γ from the same
    values and the model's d, so they must be built from the same object."""

    rounds: int
    method: str = "soteriafl-sgd"
    clip_norm: float = 1.0
    eta: float = 0.3
    k: int = 0
    gamma: float = 0.0
    batch_size: int = 0
    snapshot_prob: float = 0.0
    accountant: str = "rdp"
    record_neighbours: str = "replace-one"

    def __post_init__(self) -> None:
        from strategies.soteriafl import METHODS

        problems = []
        if self.method not in METHODS:
            problems.append(f"method = {self.method!r} must be one of {sorted(METHODS)}")
        if self.rounds < 1:
            problems.append(f"rounds = {self.rounds} must be >= 1")
        for name in ("clip_norm", "eta"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                problems.append(f"{name} = {value} must be a finite number > 0")
        if self.k < 0 or self.batch_size < 0 or self.gamma < 0:
            problems.append(f"k = {self.k}, batch_size = {self.batch_size} and gamma = {self.gamma} must be >= 0")
        if not 0 <= self.snapshot_prob <= 1:
            problems.append(f"snapshot_prob = {self.snapshot_prob} must be in [0, 1]")
        if self.accountant not in ACCOUNTANTS:
            problems.append(f"accountant = {self.accountant!r} must be one of {ACCOUNTANTS}")
        if self.record_neighbours not in RECORD_NEIGHBOURS:
            problems.append(f"record_neighbours = {self.record_neighbours!r} must be one of {RECORD_NEIGHBOURS}")
        if problems:
            raise ValueError("SoteriaFLSettings: " + "; ".join(problems))


@dataclass(frozen=True)
class DP2FedSAMSettings:
    """The DP2-FedSAM family (Zhang et al.) shared by the server and every client: ``variant`` (``dp2-fedsam``,
    ``centaur``: a personal head h_i kept on the client, only the shared body φ sent; ``dp-fedsam``,
    ``dp-fedsam-ft``, ``dp-fedavg-ft``: the full model), ``head`` (comma-separated parameter-name prefixes of your
    model's ``state_dict``, e.g. ``"fc"`` or ``"classifier.2"``; ``"auto"``: the last ``nn.Linear``), τ_h / τ_φ
    local epochs of the head / body, the head's learning rate, SAM's ρ (ASAM with ``sam_adaptive``), the FT
    variants' fine-tuning epochs and the federated evaluation period."""

    variant: str = "dp2-fedsam"
    head: str = "auto"
    tau_h: int = 2
    tau_phi: int = 2
    lr_head: float = 0.1
    sam_rho: float = 0.1
    sam_adaptive: bool = False
    sam_eta: float = 0.01
    ft_epochs: int = 1
    eval_every: int = 1

    def __post_init__(self) -> None:
        from strategies.dp2_fedsam import VARIANTS

        problems = []
        if self.variant not in VARIANTS:
            problems.append(f"variant = {self.variant!r} must be one of {sorted(VARIANTS)}")
        if self.tau_h < 1 or self.tau_phi < 1 or self.eval_every < 1 or self.ft_epochs < 0:
            problems.append(f"tau_h = {self.tau_h}, tau_phi = {self.tau_phi}, eval_every = {self.eval_every} must be "
                            f">= 1 and ft_epochs = {self.ft_epochs} >= 0")
        if not (math.isfinite(self.lr_head) and self.lr_head > 0) or self.sam_rho < 0 or not self.sam_eta > 0:
            problems.append(f"lr_head = {self.lr_head} and sam_eta = {self.sam_eta} must be > 0, sam_rho = "
                            f"{self.sam_rho} >= 0")
        if problems:
            raise ValueError("DP2FedSAMSettings: " + "; ".join(problems))


SECAGG_MECHANISMS = ("ddg", "gaussian")


@dataclass(frozen=True)
class SecAggSettings:
    """Client-level DP under Flower's SecAgg+ (the project's workflow, :mod:`fedapp.privacy.secure_aggregation`), shared
    by the strategy (:func:`~fedapp.library.server.dp_fedavg` / :func:`~fedapp.library.server.fed_smp` with
    ``secagg=``), the server's round loop (:func:`~fedapp.library.server.run_secure_aggregation`) and every client
    (:func:`~fedapp.library.clients.client_level_client` with ``secagg=``).

    ``mechanism``: the noise of each client's share of the secure sum. ``"ddg"`` (default): the distributed discrete
    Gaussian (Kairouz, Liu & Steinke 2021), residues modulo 2^``bits``, its σ raised until the sum's Rényi DP is at
    most the planned Gaussian's (run-config ``secagg-mechanism = 'ddg'``, ``secagg-bits``); ``"gaussian"``: continuous
    Gaussian shares quantized by Flower (2^22 levels), whose rounded sum's privacy is not analysed (its
    ``epsilon_vs_server_proven`` is false). ``num_shares``: SecAgg+ shares per client, a fraction of the round's
    clients in (0, 1] (1: every client, i.e. SecAgg) or an odd count >= 3; ``reconstruction_threshold``: a fraction
    of the shares in (0, 1]; ``round_timeout``: seconds the server waits for each stage's replies (0: no timeout,
    else >= 1). The defaults are the run-config's."""

    mechanism: str = "ddg"
    bits: int = 20
    num_shares: float = 1.0
    reconstruction_threshold: float = 0.5
    round_timeout: float = 0.0

    def __post_init__(self) -> None:
        problems = []
        if self.mechanism not in SECAGG_MECHANISMS:
            problems.append(f"mechanism = {self.mechanism!r} must be one of {SECAGG_MECHANISMS}")
        if isinstance(self.bits, bool) or not isinstance(self.bits, int) or not 8 <= self.bits <= 31:
            problems.append(f"bits = {self.bits!r} must be an integer in 8..31 (Flower's quantizer holds at most 31)")
        shares = self.num_shares
        if not (0 < shares <= 1 or (shares == int(shares) and int(shares) >= 3 and int(shares) % 2 == 1)):
            problems.append(f"num_shares = {shares} must be in (0, 1] or an odd integer >= 3 (Flower's SecAgg+ ring "
                            "of neighbours breaks on an even count)")
        if not 0 < self.reconstruction_threshold <= 1:
            problems.append(f"reconstruction_threshold = {self.reconstruction_threshold} must be in (0, 1]")
        if not (self.round_timeout == 0 or (math.isfinite(self.round_timeout) and self.round_timeout >= 1)):
            problems.append(f"round_timeout = {self.round_timeout} must be 0 (no timeout) or >= 1 s")
        if problems:
            raise ValueError("SecAggSettings: " + "; ".join(problems))
