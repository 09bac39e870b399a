"""The run-config as frozen dataclasses, one per concern; every field carries its default, meaning and check.

A field ``foo_bar`` is the run-config key ``foo-bar`` (``[tool.flwr.app.config]`` in pyproject.toml, ``flwr run
--run-config``). :mod:`fedapp.config.schema` reads the keys from these classes, docs/config.md is generated from
them, and ``tests/unit/fedapp/config/test_config.py`` checks that pyproject.toml agrees key by key.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from fedapp.config.keys import (
    DATASETS,
    MIN_ROUND_TIMEOUT_S,
    NODE_LOCAL,
    PARTITIONERS,
    PRIVACY_DISTS,
    _fraction,
    _nonneg,
    _positive,
    _prob,
    _unit_open,
    setting,
)


@dataclass(frozen=True)
class Section:
    """A group of run-config keys; ``SECTION`` is the name docs/config.md and the family checks use."""

    SECTION: ClassVar[str]


@dataclass(frozen=True)
class GeneralConfig(Section):
    """What runs and where: the strategy, dataset, model, rounds, seeds, outputs and the server's round settings."""

    SECTION: ClassVar[str] = "general"

    strategy: str = setting("dpsgd-fedavg", "Strategy from the registry (`fedapp.registry`).")
    model: str = setting("auto", "Model name (`fedapp.models.zoo.MODELS`), or your own model as `module.path:factory`, where `factory(input_shape, num_classes)` returns an nn.Module (importable from the app folder or an installed package; checked before the run: import, output shape on a dummy batch, Opacus' ModuleValidator for DP-SGD, dp2-head for DP2-FedSAM); auto = the dataset's default.")
    num_server_rounds: int = setting(3, "Number of federated rounds E.", check=_positive, expect="> 0")
    seed: int = setting(42, "Seed for partitions, privacy profiles and model init (not DP noise or client sampling, see seeded-noise).", check=_nonneg, expect=">= 0")
    seeded_noise: bool = setting(False, "Derive DP noise and Poisson sampling from the run seed: reproducible for tests/benchmarks, but a server that knows the seed can remove the noise, which voids the guarantee. Default: OS entropy.")
    secure_randomness: bool = setting(False, "Draw every noise sample and sampling coin the guarantee rests on from a CSPRNG (ChaCha20, 20 rounds, keyed with 256 bits of OS entropy; `randomgen`) instead of NumPy's PCG64: the client-level families (their Gaussian and discrete Gaussian shares, DP-FTRL's streams), SoteriaFL's noise and the server's client sampling. Not available for the DP-SGD clients (Opacus' secure mode needs torchcsprng, which has no build for this torch). A SuperNode can force it with node-config secure-randomness = true.")
    output_dir: str = setting("results", "Results root; each run writes a new subfolder.")
    run_name: str = setting("", "Optional prefix of the run's results subfolder.")
    tensorboard: bool = setting(False, "Also write per-round scalars (accuracy, loss, per-client ε and uplink bytes) as TensorBoard event files in the run's `tensorboard/` subfolder.")
    device: str = setting("auto", "Training device: auto (CUDA when available), cpu or cuda.", choices=("auto", "cpu", "cuda"))
    num_clients: int = setting(0, "Expected number of clients (0 = all that connect); simulation uses num-supernodes.", check=_nonneg, expect=">= 0")
    min_available_clients: int = setting(2, "Server waits for this many clients; a federation needs at least 2.", check=lambda v: v >= 2, expect=">= 2")
    clients_per_round: int = setting(0, "Clients sampled per round r (0 = full participation).", check=_nonneg, expect=">= 0")
    fraction_evaluate: float = setting(1.0, "Fraction of clients doing federated evaluation each round.", check=lambda v: 0 <= v <= 1, expect="in [0, 1]")
    evaluate_every: int = setting(1, "Evaluate the global model (the server's test set and federated evaluation) every this many rounds and after the last.", check=_positive, expect="> 0")
    eval_batch_size: int = setting(512, "Batch size for evaluation.", check=_positive, expect="> 0")
    server_lr: float = setting(1.0, "Server step on the aggregated update: θ ← θ + server-lr · Σ w_i Δ_i.", check=_positive, expect="> 0")
    audit_canaries: int = setting(0, "Empirical privacy audit (simulation). Client-level families (dp-fedavg, fed-smp-*, dp-ftrl, the DP2-FedSAM family): the last k of the federation's clients are canaries that send a fixed random direction of norm clip-norm through the run's mechanism (sampling, clipping, noise share, SecAgg+) instead of training; summary.json's `audit` block gives the one-shot ε estimate (Andrew et al. 2024). Record-level families (DP-SGD: robust-hdp, weiavg, pfa, min-eps, dpsgd-fedavg; SoteriaFL): k canary slots, slot j in client j mod n's training data, each holding one of two random records by a secret coin; the block gives the one-run ε lower bound (Steinke et al. 2023). Either beside the accountant's ε (`strategies/privacy/audit.py`). Canaries never count in the summary's ε per client. 0 = off.", check=_nonneg, expect=">= 0")
    audit_seed: int = setting(0, "Seed of the audit canaries' directions (the auditor's; never the DP noise).", check=_nonneg, expect=">= 0")


@dataclass(frozen=True)
class DataConfig(Section):
    """The dataset, the training pool (capped, minus the server's public set) and how it is cut into clients and
    each client's data into train, validation and test."""

    SECTION: ClassVar[str] = "data"

    dataset: str = setting("digits", "Dataset: a name listed here (digits is embedded), `hf:<name or folder>[?option=value&...]`, a Hugging Face dataset (`fedapp/data/hf_data.py`), `module.path:loader`, your own: `loader()` returns (train, test), each (x, y) arrays or a torch Dataset of (x, y) items (`fedapp/data/user_data.py`), or node-local: every SuperNode trains on its own file or folder, named by its node-config `data-path` (`fedapp/data/node_data.py`; needs `input-shape` and `num-classes`; evaluation is then federated only). The last three need an explicit `model`.", choices=(*DATASETS, NODE_LOCAL), prefix="hf:")
    input_shape: str = setting("", "dataset = node-local: the shape of one example, e.g. [16] or [1, 28, 28]. Flower's run-config holds no arrays: give it as a string (`input-shape = \"[1, 28, 28]\"`; `flwr run --run-config \"input-shape='[16]'\"`); this project's launchers also take the array, written without spaces (`input-shape=[1,28,28]`). The server builds the model from it; each node checks its data against it.")
    num_classes: int = setting(0, "dataset = node-local: the number of classes k (labels 0..k-1); each node checks its labels against it.", check=_nonneg, expect=">= 0")
    data_dir: str = setting("", "Folder holding MNIST/CIFAR (torchvision's folder layout) / LIBSVM data (e.g. ../shared/data). Required except for digits and hf: datasets (for which it is the base of relative folders and the Hub download cache).")
    partitioner: str = setting("iid", "Data split: iid, shards (McMahan), pathological (S classes each), dirichlet.", choices=PARTITIONERS)
    shards_per_client: int = setting(8, "shards: shards per client (n·s shards cut from label-sorted data).", check=_positive, expect="> 0")
    classes_per_client: int = setting(2, "pathological: classes S per client.", check=_positive, expect="> 0")
    dirichlet_alpha: float = setting(0.5, "dirichlet: concentration α.", check=_positive, expect="> 0")
    local_test_fraction: float = setting(0.2, "Fraction of each client's partition kept as its local test split.", check=_fraction, expect="in [0, 1)")
    validation_fraction: float = setting(0.0, "Fraction of each client's training part held out as its validation split (tuning; never trained on, never reported as test).", check=_fraction, expect="in [0, 1)")
    max_samples: int = setting(0, "Use at most this many training samples before partitioning (0 = all).", check=_nonneg, expect=">= 0")
    public_samples: int = setting(0, "Training examples held out of every client's data as the server's public set D_p (top-k needs > 0).", check=_nonneg, expect=">= 0")


@dataclass(frozen=True)
class TrainingConfig(Section):
    """Client training and record-level DP-SGD: per-client ε_i, δ_i, batch sizes, clipping, accountant, optimiser."""

    SECTION: ClassVar[str] = "privacy"

    privacy_dist: str = setting("dist2", "ε_i distribution (Robust-HDP Table 7) or fixed (use `epsilon`).", choices=PRIVACY_DISTS)
    epsilon: float = setting(1.0, "ε of every client when privacy-dist = fixed (record-level DP strategies; any other privacy-dist draws ε_i and refuses a non-default epsilon, client-level DP uses target-epsilon). The run's noise calibration must reach it: one that no noise multiplier achieves at `delta` is refused before the run starts.", check=_positive, expect="> 0")
    epsilon_floor: float = setting(0.05, "Draws of ε below this are redrawn (Table 7 normals can go ≤ 0).", check=_positive, expect="> 0")
    delta: float = setting(1e-4, "δ_i of every client (record-level DP-SGD); at most 1/(10·N_i) unless allow-large-delta.", check=_unit_open, expect="in (0, 1)")
    allow_large_delta: bool = setting(False, "Permit δ above 1/(10·N) of the protected unit (a client's records for record-level DP, the clients for client-level DP), including the δ that SecAgg+'s minimum cohort of 3 adds to client-dp-adversary = release (docs/privacy.md).")
    batch_size: int = setting(0, "Fixed batch size b_i (0 = draw uniformly from batch-size-choices).", check=_nonneg, expect=">= 0")
    batch_size_choices: str = setting("8,16,24,32", "Comma-separated batch sizes drawn uniformly per client (Robust-HDP: 16,32,64,128).")
    local_epochs: int = setting(1, "Local epochs K_i per round.", check=_positive, expect="> 0")
    clip_norm: float = setting(3.0, "Clipping bound: per-sample c for DP-SGD; per-update C for client-level DP.", check=_positive, expect="> 0")
    dp_rounds: int = setting(0, "Rounds the budget is planned for (0 = num-server-rounds); beyond it clients refuse.", check=_nonneg, expect=">= 0")
    accountant: str = setting("rdp", "Opacus accountant for DP-SGD: rdp or prv.", choices=("rdp", "prv"))
    record_neighbours: str = setting("replace-one", "Record-level DP (DP-SGD, SoteriaFL clients): which datasets are neighbours. replace-one (default): one record swapped for another, same N_i; it fits what a client releases (num_examples = N_i, and its q_i and step count are functions of N_i), and costs about twice the add/remove ε at the same noise; composed by dp_accounting's PLD accountant whatever `accountant` says (Opacus' accountants and dp_accounting's RDP have no replace-one analysis of Poisson sampling). add-remove: one record added or removed (Opacus' analysis, composed by `accountant`); it protects nothing once N_i is released, since that size tells such neighbours apart. Client-level families are unaffected (their neighbours are whole clients added or removed).", choices=("replace-one", "add-remove"))
    grad_sample_mode: str = setting("auto", "Per-sample gradient mode of DP-SGD: auto (the fastest the model supports, measured once per model/batch/device), Opacus' hooks, ew or functorch, or bk (book-keeping with mixed ghost norms: no weight gradients in the backward pass, no second pass; fedapp/clients/book_keeping.py). Each computes the same clipped, noised gradient.", choices=("auto", "hooks", "ew", "functorch", "bk"))
    cuda_graphs: bool = setting(False, "DP-SGD on a GPU: replay each step as one CUDA graph (Opacus hooks over Poisson batches padded to a fixed size, padded rows weighted 0: the same batches, clipping, noise and accounting; `fedapp/clients/graphed_dpsgd.py`). Needs a CUDA device (device = cuda, or auto where clients have one) and grad-sample-mode = hooks or auto.")
    lr: float = setting(0.05, "Client learning rate η.", check=_positive, expect="> 0")
    momentum: float = setting(0.0, "Client SGD momentum (reset every round).", check=lambda v: 0 <= v < 1, expect="in [0, 1)")
    lr_decay: float = setting(1.0, "Client learning rate multiplied by this every round.", check=_prob, expect="in (0, 1]")
    falsify_client: int = setting(-1, "Partition id of a client that reports a falsified ε (-1 = none).", check=lambda v: v >= -1, expect=">= -1")
    falsify_epsilon: float = setting(0.0, "The falsified ε that client reports (it still trains with its true ε).", check=_nonneg, expect=">= 0")


@dataclass(frozen=True)
class ClientDPConfig(Section):
    """Client-level DP (DP-FedAvg, Fed-SMP; shared with DP2-FedSAM): σ or target ε, whom it holds against, SecAgg+, sparsification."""

    SECTION: ClassVar[str] = "fed-smp"

    noise_multiplier: float = setting(0.0, "Client-level DP σ: the sum of the r clipped updates carries N(0, C²σ²); 0 = calibrate to target-epsilon.", check=_nonneg, expect=">= 0")
    target_epsilon: float = setting(1.0, "Client-level ε over dp-rounds rounds (q = r/n, δ = client-delta) used when noise-multiplier = 0.", check=_positive, expect="> 0")
    client_delta: float = setting(0.0, "Client-level δ; 0 = 1/(10 n) (at most that unless allow-large-delta).", check=_fraction, expect="in [0, 1)")
    compression_ratio: float = setting(0.01, "Fed-SMP / FedAvg-randk/topk p = k/d: fraction of coordinates kept by the round's mask.", check=_prob, expect="in (0, 1]")
    local_steps: int = setting(0, "Local SGD steps τ per round of client-level DP clients (0 = local-epochs · ⌈N/b⌉).", check=_nonneg, expect=">= 0")
    secure_aggregation: bool = setting(True, "Client-level DP families: sum the updates with Flower's SecAgg+ so the server sees only the aggregate (false = the server sees every update, so σ is calibrated for one update's ε: √r times the noise).")
    client_dp_adversary: str = setting("server", "Client-level DP: whom the budget holds against. server (default): the server that draws the sample and sees who replies, so no amplification by sampling: σ is calibrated so that dp-rounds unamplified Gaussian rounds spend target-epsilon, and the budget is enforced on epsilon_vs_server. release: whoever sees only the released models, amplified by secret Poisson sampling at q = r/n (the papers' accounting; weaker, say so when you report it). The same with full participation (q = 1).", choices=("server", "release"))
    secagg_mechanism: str = setting("auto", "Client-level DP under SecAgg+: the noise each client adds to its share of the secure sum. auto (default): ddg, except gaussian where the run needs it (dp-ftrl, adaptive clipping, client-dp-adversary = release, an accountant other than rdp). ddg: the distributed discrete Gaussian (Kairouz, Liu, Steinke 2021): rotated, scaled, conditionally rounded integer updates plus discrete Gaussian noise, summed modulo 2^secagg-bits, σ raised until its Rényi DP is at most the planned Gaussian's (needs accountant = rdp and client-dp-adversary = server). gaussian: continuous Gaussian noise, then Flower's stochastic quantizer (2^22 levels); the privacy of that rounded sum is not analysed here (its epsilon_vs_server is reported as not proven).", choices=("auto", "ddg", "gaussian"))
    secagg_bits: int = setting(20, "secagg-mechanism = ddg: bits b of the modular sum (the field 2^b; Flower's quantizer holds at most 31). Fewer bits round more coarsely and cost more noise for the same ε; the plan refuses a width that cannot reach it.", check=lambda v: 8 <= v <= 31, expect="in 8..31")
    secagg_num_shares: float = setting(1.0, "SecAgg+ shares per client: a fraction of the round's sampled clients (1 = all, i.e. SecAgg) or, if > 1, a count: an odd integer >= 3 (Flower's SecAgg+ ring of neighbours breaks on an even count: every client fails its key sharing).", check=lambda v: 0 < v <= 1 or (v == int(v) and int(v) >= 3 and int(v) % 2 == 1), expect="in (0, 1] or an odd integer >= 3")
    secagg_threshold: float = setting(0.5, "SecAgg+ reconstruction threshold as a fraction of the shares (the most dropouts a round survives).", check=_prob, expect="in (0, 1]")
    public_steps: int = setting(0, "τ_p: server SGD steps on D_p to pick the top-k mask (0 = same as local-steps).", check=_nonneg, expect=">= 0")
    ftrl_mechanism: str = setting("banded", "dp-ftrl: the matrix factorization of the correlated noise. banded (default): a b-banded Toeplitz C optimised for the run's dp-rounds and ftrl-bands (Choquette-Choo et al., NeurIPS 2023); tree: binary-tree aggregation with the online estimator (Kairouz et al., ICML 2021), restarted every ftrl-restart-every rounds.", choices=("banded", "tree"))
    ftrl_bands: int = setting(1, "dp-ftrl, ftrl-mechanism = banded: bands b of C, at most dp-rounds. 1 (default) is independent noise every round, the best band when every client contributes in every round: there any b > 1, and the tree, raise the prefix-sum error at equal ε (no factorization gains more than √1.5 over b = 1, strategies/dp_ftrl.py). Bands pay off with ftrl-min-separation > 1 (at most that many bands keep a client's columns orthogonal).", check=_positive, expect="> 0")
    ftrl_restart_every: int = setting(0, "dp-ftrl, ftrl-mechanism = tree: start a new tree every this many rounds (0 = one tree for the run).", check=_nonneg, expect=">= 0")
    ftrl_min_separation: int = setting(1, "dp-ftrl: b, the rounds between two of a client's contributions (Choquette-Choo et al., NeurIPS 2023, b-min-separated participation). Client i trains and adds its clipped update only in the rounds t with (t - 1 - i) mod b = 0, a public schedule each client enforces itself (it refuses a round of its turn that is not later than its last); every client still takes part in every round, sending only its noise-stream share (SecAgg+) or a zero update (central) outside its turn. The accountant uses that pattern: at most ceil(T/b) contributions, any two at least b rounds apart; with ftrl-bands <= b the columns of C a client touches are orthogonal and sens^2 = ceil(T/b) times the band's squared norm. 1 (default): every client trains in every round. At most dp-rounds; needs clients-per-round = 0.", check=_positive, expect="> 0")
    adaptive_clip_quantile: float = setting(0.0, "dp-fedavg, fed-smp-randk, fed-smp-topk and the DP2-FedSAM family (dp2-fedsam, centaur, dp-fedsam, dp-fedsam-ft, dp-fedavg-ft): target quantile γ of the update norms that adaptive clipping steers the clip norm to (Andrew et al. 2021); clip-norm is then the initial C_0 and each round C_{t+1} = C_t · exp(−η_C (b̄_t − γ)), b̄_t the noisy fraction of unclipped updates, each bit taken on the vector the strategy clips (Fed-SMP: the sparsified k values, rand-k after its d/k scaling; DP2-FedSAM: the shared-part update). Not dp-ftrl: its correlated noise's sensitivity is analysed for a fixed clip across rounds. Without SecAgg+ each client sends its noised bit as a metric; with secure-aggregation = true (secagg-mechanism = 'gaussian' only: the ddg's bound does not cover a count coordinate) it rides as one extra coordinate of the secure sum, so the server learns only the sum of the noised bits; this holds against a server that follows the protocol, not one that sends different clip norms to different clients. 0 (default) = a fixed clip-norm.", check=lambda v: v == 0 or 0 < v < 1, expect="0 (off) or in (0, 1)")
    adaptive_clip_lr: float = setting(0.2, "Adaptive clipping: learning rate η_C of the geometric clip update (Andrew et al. 2021 use 0.2).", check=_positive, expect="> 0")
    adaptive_clip_count_noise: float = setting(0.0, "Adaptive clipping: std σ_b of the noise on the count of unclipped updates (each client adds its share σ_b/√r to its centred bit; r_t, the round's sampled count, under SecAgg+). The update noise rises to z_Δ = (z⁻² − (2σ_b)⁻²)^(−1/2) so that a round costs what it costs at z (Andrew et al. 2021, Thm 1); needs σ_b > z/2. 0 = r/20, r = clients per round (the paper's choice: the fraction's noise std is 0.05), or z where r/20 does not exceed z/2 (z_Δ is then 2z/√3 ≈ 1.155 z).", check=_nonneg, expect=">= 0")


@dataclass(frozen=True)
class DP2FedSAMConfig(Section):
    """DP2-FedSAM family: the personal head, local epochs of each part, SAM/ASAM, fine-tuning baselines."""

    SECTION: ClassVar[str] = "dp2-fedsam"

    dp2_head: str = setting("auto", "Personal head h: comma-separated parameter-name prefixes; auto = last nn.Linear (DP2-FedSAM Sec. 5.1).")
    dp2_tau_h: int = setting(2, "τ_h: local epochs of SGD on the head h_i (φ fixed) per round.", check=_positive, expect="> 0")
    dp2_tau_phi: int = setting(2, "τ_φ: local epochs of SAM/SGD on the shared φ (h_i fixed) per round; full-model variants use local-epochs.", check=_positive, expect="> 0")
    dp2_lr_head: float = setting(0.1, "η_h: head learning rate (decayed by lr-decay per round); φ and full models use lr.", check=_positive, expect="> 0")
    sam_rho: float = setting(0.1, "SAM perturbation radius q (Eq. 11).", check=_nonneg, expect=">= 0")
    sam_adaptive: bool = setting(False, "Use ASAM (Kwon et al. 2021): perturbation scaled by |w| + sam-eta.")
    sam_eta: float = setting(0.01, "ASAM η in T_w = |w| + η.", check=_positive, expect="> 0")
    ft_epochs: int = setting(1, "FT baselines: local fine-tuning epochs of the global model before evaluation.", check=_nonneg, expect=">= 0")
    dp2_eval_every: int = setting(1, "Federated evaluation every this many rounds (and the last round), in rounds that evaluate-every also evaluates.", check=_positive, expect="> 0")
    dp2_report_norms: bool = setting(False, "Clients report their pre-clip ‖Δ_i‖ (Fig. 5 diagnostic; NOT privatized, leaks it to the server).")


@dataclass(frozen=True)
class RobustHDPConfig(Section):
    """Robust-HDP family: Robust PCA solver settings, frozen weights, PFA's subspace."""

    SECTION: ClassVar[str] = "robust-hdp"

    rpca_tol: float = setting(1e-4, "Robust PCA stops when ‖M − L − S‖_F ≤ rpca-tol · ‖M‖_F (Lin et al. 2010); 1e-4 moves the weights < 0.1 % from a 1e-9 solve.", check=_positive, expect="> 0")
    rpca_max_iter: int = setting(500, "Robust PCA iteration cap (inexact ALM).", check=_positive, expect="> 0")
    rpca_svd: str = setting("gram", "Thin SVD of the p × n iterate: gram (n × n XᵀX, fastest) or qr (R factor, more accurate).", choices=("gram", "qr"))
    rpca_backend: str = setting("numpy", "Robust PCA backend: numpy or torch.", choices=("numpy", "torch"))
    rpca_device: str = setting("cpu", "Device of the torch RPCA backend: cpu or cuda.", choices=("cpu", "cuda"))
    rpca_float32: bool = setting(True, "Run Robust PCA in float32 (half the memory traffic of float64; keep rpca-tol >= 1e-6).")
    rpca_chunk_rows: int = setting(0, "Robust-HDP Sec. 3.6: RPCA on blocks of p' rows (0 = the whole p × n matrix).", check=_nonneg, expect=">= 0")
    rpca_chunks: int = setting(0, "Sec. 3.6: number Q of row blocks used, from the top (0 = all ⌊p/p'⌋; 1 = first block only).", check=_nonneg, expect=">= 0")
    robust_hdp_freeze_weights: bool = setting(False, "Robust-HDP weights from the first round, then frozen (published code); false = recomputed every round (Algorithm 1).")
    pfa_components: int = setting(1, "PFA: dimension k of the public principal subspace private updates are projected on.", check=_positive, expect="> 0")


@dataclass(frozen=True)
class SoteriaFLConfig(Section):
    """SoteriaFL family: server step, random-k, shift step, minibatch and SVRG snapshot rules."""

    SECTION: ClassVar[str] = "soteriafl"

    nonconvex_lambda: float = setting(0.0, "λ of the nonconvex regularizer λ Σ x_j²/(1 + x_j²) of the logreg model (SoteriaFL Sec. 6.1: 0.2).", check=_nonneg, expect=">= 0")
    soteriafl_eta: float = setting(0.3, "SoteriaFL family: server step size η in x ← x − η v (Sec. 6 grid {0.01, ..., 1}).", check=_positive, expect="> 0")
    soteriafl_k: int = setting(0, "Random-k sparsification: coordinates sent per round (0 = ⌊d/20⌋, Sec. 6).", check=_nonneg, expect=">= 0")
    soteriafl_gamma: float = setting(0.0, "Shift step γ (0 = theory sqrt((1+2ω)/(2(1+ω)³))).", check=_nonneg, expect=">= 0")
    soteriafl_batch_size: int = setting(0, "Minibatch b (expected Poisson size; 0 = Corollary 1/2/3 rule: SGD formula, SVRG m^(2/3)/4, SAGA 3m^(2/3)).", check=_nonneg, expect=">= 0")
    soteriafl_snapshot_prob: float = setting(0.0, "SVRG snapshot refresh probability p (0 = b/m, Corollary 2).", check=lambda v: 0 <= v <= 1, expect="in [0, 1]")
    soteriafl_utility: bool = setting(True, "Server computes ‖∇f(x_t)‖² and the training loss on the full training data each round (diagnostic).")


@dataclass(frozen=True)
class DeploymentConfig(Section):
    """Deployment: checkpoint and resume, fault injection, timeouts, minimum clients, budgets across runs, strikes."""

    SECTION: ClassVar[str] = "deployment"

    resume_from: str = setting("", "Checkpoint (checkpoint.npz or its run folder) to continue; the resumed run writes a new folder with the full ledger.")
    checkpoint_every: int = setting(1, "Write checkpoint.npz (atomic) every this many rounds and after the last (0 = never).", check=_nonneg, expect=">= 0")
    client_state_dir: str = setting("", "Folder where clients journal their Context.state (accountants, shifts, heads) per run lineage and round, so a resumed run continues from the last committed round ('' = <output-dir>/.client-state).")
    fault_fraction: float = setting(0.0, "Fraction of clients that fail each round (chosen by seed and round; fault injection for tests).", check=_fraction, expect="in [0, 1)")
    fault_mode: str = setting("raise", "How an injected fault fails: raise (exception before training) or timeout (sleep fault-delay, then train).", choices=("raise", "timeout"))
    fault_delay: float = setting(30.0, "Seconds a timing-out client sleeps (set above round-timeout).", check=_positive, expect="> 0")
    round_timeout: float = setting(0.0, "Seconds the server waits for client replies each round: 0 = no timeout, else at least 1 (a reply needs a message round trip and local training, so a shorter timeout fails every round; it is most likely milliseconds given for seconds).", check=lambda v: v == 0 or v >= MIN_ROUND_TIMEOUT_S, expect=f"0 (no timeout) or >= {MIN_ROUND_TIMEOUT_S:g} s")
    min_fit_clients: int = setting(0, "Fewest acceptable updates a round needs; fewer aborts the run with a clear message (0 = no minimum).", check=_nonneg, expect=">= 0")
    lifetime_budget: bool = setting(False, "Clients keep the ε of every run in their state folder and refuse once earlier runs plus this one would exceed their budget (basic composition across runs; always on for SuperNodes given a node-config state-dir).")
    strike_limit: int = setting(3, "Rejected updates after which a client is excluded from later rounds (0 = never exclude).", check=_nonneg, expect=">= 0")
    robust_norm_factor: float = setting(10.0, "Strategies without a declared update-norm bound (FedAvg, the Robust-HDP family) reject an update above this multiple of the median norm of the round's other updates (with 3 or more) or of the last 256 accepted norms of earlier rounds, whatever the round's size; in a round of two with no history yet, the larger of two updates more than this factor apart is rejected without a strike (0 = off).", check=_nonneg, expect=">= 0")


#: the run-config's sections: RunConfig attribute → dataclass
SECTION_CLASSES: dict[str, type[Section]] = {
    "general": GeneralConfig,
    "data": DataConfig,
    "training": TrainingConfig,
    "client_dp": ClientDPConfig,
    "dp2_fedsam": DP2FedSAMConfig,
    "robust_hdp": RobustHDPConfig,
    "soteriafl": SoteriaFLConfig,
    "deployment": DeploymentConfig,
}
