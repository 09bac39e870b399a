"""Run configuration: one schema (type, default, meaning) for every run-config key.

Flower passes ``[tool.flwr.app.config]`` (overridable with ``flwr run --run-config``) as a
flat mapping. :func:`resolve_config` merges it over the schema defaults, coerces types and
validates every value *before* any training starts or any results folder is created.
``tests/test_config.py`` checks that ``pyproject.toml`` and this schema agree key by key,
and the README's config table is generated from :data:`SCHEMA` (``python -m fedapp.config``).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from strategies.errors import ConfigError

__all__ = ["SCHEMA", "ConfigError", "Key", "RunConfig", "resolve_config"]

PRIVACY_DISTS = tuple(f"dist{i}" for i in range(1, 10)) + ("fixed",)
DATASETS = ("digits", "mnist", "fmnist", "cifar10", "cifar100", "a9a")
PARTITIONERS = ("iid", "shards", "pathological", "dirichlet")
MIN_ROUND_TIMEOUT_S = 1.0  # the shortest round-timeout accepted (0 = none)


@dataclass(frozen=True)
class Key:
    """One run-config key: its type, default, meaning and an optional check."""

    name: str
    type: type
    default: Any
    doc: str
    check: Callable[[Any], bool] | None = None
    expect: str = ""  # human-readable constraint used in error messages
    choices: tuple[str, ...] | None = None
    section: str = "general"
    prefix: str = ""  # values starting with it are accepted besides the choices (dataset = 'hf:...')


def _positive(v: Any) -> bool:
    return v > 0


def _nonneg(v: Any) -> bool:
    return v >= 0


def _unit_open(v: Any) -> bool:
    return 0 < v < 1


def _fraction(v: Any) -> bool:
    return 0 <= v < 1


def _prob(v: Any) -> bool:
    return 0 < v <= 1


_KEYS: list[Key] = [
    # --- general -------------------------------------------------------------------
    Key("strategy", str, "dpsgd-fedavg", "Strategy from the registry (`fedapp.registry`)."),
    Key("dataset", str, "digits", "Dataset: a name listed here (digits is embedded) or `hf:<name or folder>[?option=value&...]`, a Hugging Face dataset (`fedapp/data/hf_data.py`; needs an explicit `model`).",
        choices=DATASETS, prefix="hf:"),
    Key("data-dir", str, "", "Folder holding MNIST/CIFAR (torchvision's folder layout) / LIBSVM data (e.g. ../shared/data). Required except for digits and hf: datasets (for which it is the base of relative folders and the Hub download cache)."),
    Key("model", str, "auto", "Model name (`fedapp.models.zoo.MODELS`); auto = the dataset's default."),
    Key("num-server-rounds", int, 3, "Number of federated rounds E.", _positive, "> 0"),
    Key("seed", int, 42, "Seed for partitions, privacy profiles and model init (not DP noise or client sampling, see seeded-noise).", _nonneg, ">= 0"),
    Key("seeded-noise", bool, False, "Derive DP noise and Poisson sampling from the run seed: reproducible for tests/benchmarks, but a server that knows the seed can remove the noise, which voids the guarantee. Default: OS entropy."),
    Key("output-dir", str, "results", "Results root; each run writes a new subfolder."),
    Key("run-name", str, "", "Optional prefix of the run's results subfolder."),
    Key("tensorboard", bool, False, "Also write per-round scalars (accuracy, loss, per-client ε and uplink bytes) as TensorBoard event files in the run's `tensorboard/` subfolder."),
    Key("device", str, "auto", "Training device: auto (CUDA when available), cpu or cuda.", choices=("auto", "cpu", "cuda")),
    Key("num-clients", int, 0, "Expected number of clients (0 = all that connect); simulation uses num-supernodes.", _nonneg, ">= 0"),
    Key("min-available-clients", int, 2, "Server waits for this many clients; a federation needs at least 2.", lambda v: v >= 2, ">= 2"),
    Key("clients-per-round", int, 0, "Clients sampled per round r (0 = full participation).", _nonneg, ">= 0"),
    Key("fraction-evaluate", float, 1.0, "Fraction of clients doing federated evaluation each round.", lambda v: 0 <= v <= 1, "in [0, 1]"),
    Key("eval-batch-size", int, 512, "Batch size for evaluation.", _positive, "> 0"),
    Key("server-lr", float, 1.0, "Server step on the aggregated update: θ ← θ + server-lr · Σ w_i Δ_i.", _positive, "> 0"),
    # --- data ----------------------------------------------------------------------
    Key("partitioner", str, "iid", "Data split: iid, shards (McMahan), pathological (S classes each), dirichlet.", choices=PARTITIONERS, section="data"),
    Key("shards-per-client", int, 8, "shards: shards per client (n·s shards cut from label-sorted data).", _positive, "> 0", section="data"),
    Key("classes-per-client", int, 2, "pathological: classes S per client.", _positive, "> 0", section="data"),
    Key("dirichlet-alpha", float, 0.5, "dirichlet: concentration α.", _positive, "> 0", section="data"),
    Key("local-test-fraction", float, 0.2, "Fraction of each client's partition kept as its local test split.", _fraction, "in [0, 1)", section="data"),
    Key("validation-fraction", float, 0.0, "Fraction of each client's training part held out as its validation split (tuning; never trained on, never reported as test).", _fraction, "in [0, 1)", section="data"),
    Key("max-samples", int, 0, "Use at most this many training samples before partitioning (0 = all).", _nonneg, ">= 0", section="data"),
    # --- client training / privacy -------------------------------------------------
    Key("privacy-dist", str, "dist2", "ε_i distribution (Robust-HDP Table 7) or fixed (use `epsilon`).", choices=PRIVACY_DISTS, section="privacy"),
    Key("epsilon", float, 1.0, "ε of every client when privacy-dist = fixed (record-level DP strategies; any other privacy-dist draws ε_i and refuses a non-default epsilon, client-level DP uses target-epsilon). The run's noise calibration must reach it: one that no noise multiplier achieves at `delta` is refused before the run starts.", _positive, "> 0", section="privacy"),
    Key("epsilon-floor", float, 0.05, "Draws of ε below this are redrawn (Table 7 normals can go ≤ 0).", _positive, "> 0", section="privacy"),
    Key("delta", float, 1e-4, "δ_i of every client (record-level DP-SGD); at most 1/(10·N_i) unless allow-large-delta.", _unit_open, "in (0, 1)", section="privacy"),
    Key("allow-large-delta", bool, False, "Permit δ above 1/(10·N) of the protected unit (a client's records for record-level DP, the clients for client-level DP).", section="privacy"),
    Key("batch-size", int, 0, "Fixed batch size b_i (0 = draw uniformly from batch-size-choices).", _nonneg, ">= 0", section="privacy"),
    Key("batch-size-choices", str, "8,16,24,32", "Comma-separated batch sizes drawn uniformly per client (Robust-HDP: 16,32,64,128).", section="privacy"),
    Key("local-epochs", int, 1, "Local epochs K_i per round.", _positive, "> 0", section="privacy"),
    Key("clip-norm", float, 3.0, "Clipping bound: per-sample c for DP-SGD; per-update C for client-level DP.", _positive, "> 0", section="privacy"),
    Key("dp-rounds", int, 0, "Rounds the budget is planned for (0 = num-server-rounds); beyond it clients refuse.", _nonneg, ">= 0", section="privacy"),
    Key("accountant", str, "rdp", "Opacus accountant for DP-SGD: rdp or prv.", choices=("rdp", "prv"), section="privacy"),
    Key("record-neighbours", str, "replace-one", "Record-level DP (DP-SGD, SoteriaFL clients): which datasets are neighbours. replace-one (default): one record swapped for another, same N_i; it fits what a client releases (num_examples = N_i, and its q_i and step count are functions of N_i), and costs about twice the add/remove ε at the same noise; composed by dp_accounting's PLD accountant whatever `accountant` says (Opacus' accountants and dp_accounting's RDP have no replace-one analysis of Poisson sampling). add-remove: one record added or removed (Opacus' analysis, composed by `accountant`); it protects nothing once N_i is released, since that size tells such neighbours apart. Client-level families are unaffected (their neighbours are whole clients added or removed).", choices=("replace-one", "add-remove"), section="privacy"),
    Key("grad-sample-mode", str, "auto", "Opacus per-sample gradient mode: auto (the fastest the model supports, measured once per model/batch/device), hooks, ew, functorch.", choices=("auto", "hooks", "ew", "functorch"), section="privacy"),
    Key("lr", float, 0.05, "Client learning rate η.", _positive, "> 0", section="privacy"),
    Key("momentum", float, 0.0, "Client SGD momentum (reset every round).", lambda v: 0 <= v < 1, "in [0, 1)", section="privacy"),
    Key("lr-decay", float, 1.0, "Client learning rate multiplied by this every round.", _prob, "in (0, 1]", section="privacy"),
    Key("falsify-client", int, -1, "Partition id of a client that reports a falsified ε (-1 = none).", lambda v: v >= -1, ">= -1", section="privacy"),
    Key("falsify-epsilon", float, 0.0, "The falsified ε that client reports (it still trains with its true ε).", _nonneg, ">= 0", section="privacy"),
    # --- fed-smp: client-level DP (DP-FedAvg, Fed-SMP; shared with DP2-FedSAM) -----
    Key("noise-multiplier", float, 0.0, "Client-level DP σ: the sum of the r clipped updates carries N(0, C²σ²); 0 = calibrate to target-epsilon.", _nonneg, ">= 0", section="fed-smp"),
    Key("target-epsilon", float, 1.0, "Client-level ε over dp-rounds rounds (q = r/n, δ = client-delta) used when noise-multiplier = 0.", _positive, "> 0", section="fed-smp"),
    Key("client-delta", float, 0.0, "Client-level δ; 0 = 1/(10 n) (at most that unless allow-large-delta).", _fraction, "in [0, 1)", section="fed-smp"),
    Key("compression-ratio", float, 0.01, "Fed-SMP / FedAvg-randk/topk p = k/d: fraction of coordinates kept by the round's mask.", _prob, "in (0, 1]", section="fed-smp"),
    Key("local-steps", int, 0, "Local SGD steps τ per round of client-level DP clients (0 = local-epochs · ⌈N/b⌉).", _nonneg, ">= 0", section="fed-smp"),
    Key("public-samples", int, 0, "Training examples held out of every client's data as the server's public set D_p (top-k needs > 0).", _nonneg, ">= 0", section="fed-smp"),
    Key("secure-aggregation", bool, True, "Client-level DP families: sum the updates with Flower's SecAgg+ so the server sees only the aggregate (false = the server sees every update, so σ is calibrated for one update's ε: √r times the noise).", section="fed-smp"),
    Key("client-dp-adversary", str, "server", "Client-level DP: whom the budget holds against. server (default): the server that draws the sample and sees who replies, so no amplification by sampling: σ is calibrated so that dp-rounds unamplified Gaussian rounds spend target-epsilon, and the budget is enforced on epsilon_vs_server. release: whoever sees only the released models, amplified by secret Poisson sampling at q = r/n (the papers' accounting; weaker, say so when you report it). The same with full participation (q = 1).", choices=("server", "release"), section="fed-smp"),
    Key("secagg-mechanism", str, "ddg", "Client-level DP under SecAgg+: the noise each client adds to its share of the secure sum. ddg (default): the distributed discrete Gaussian (Kairouz, Liu, Steinke 2021): rotated, scaled, conditionally rounded integer updates plus discrete Gaussian noise, summed modulo 2^secagg-bits, σ raised until its Rényi DP is at most the planned Gaussian's (needs accountant = rdp and client-dp-adversary = server). gaussian: continuous Gaussian noise, then Flower's stochastic quantizer (2^22 levels); the privacy of that rounded sum is not analysed here.", choices=("ddg", "gaussian"), section="fed-smp"),
    Key("secagg-bits", int, 20, "secagg-mechanism = ddg: bits b of the modular sum (the field 2^b; Flower's quantizer holds at most 31). Fewer bits round more coarsely and cost more noise for the same ε; the plan refuses a width that cannot reach it.", lambda v: 8 <= v <= 31, "in 8..31", section="fed-smp"),
    Key("secagg-num-shares", float, 1.0, "SecAgg+ shares per client: a fraction of the round's sampled clients (1 = all, i.e. SecAgg) or, if > 1, a count: an odd integer >= 3 (Flower's SecAgg+ ring of neighbours breaks on an even count: every client fails its key sharing).", lambda v: 0 < v <= 1 or (v == int(v) and int(v) >= 3 and int(v) % 2 == 1), "in (0, 1] or an odd integer >= 3", section="fed-smp"),
    Key("secagg-threshold", float, 0.5, "SecAgg+ reconstruction threshold as a fraction of the shares (the most dropouts a round survives).", _prob, "in (0, 1]", section="fed-smp"),
    Key("public-steps", int, 0, "τ_p: server SGD steps on D_p to pick the top-k mask (0 = same as local-steps).", _nonneg, ">= 0", section="fed-smp"),
    # --- dp2-fedsam: personalized partial sharing + SAM (DP2-FedSAM, CENTAUR, DP-FedSAM, FT baselines) ---
    Key("dp2-head", str, "auto", "Personal head h: comma-separated parameter-name prefixes; auto = last nn.Linear (DP2-FedSAM Sec. 5.1).", section="dp2-fedsam"),
    Key("dp2-tau-h", int, 2, "τ_h: local epochs of SGD on the head h_i (φ fixed) per round.", _positive, "> 0", section="dp2-fedsam"),
    Key("dp2-tau-phi", int, 2, "τ_φ: local epochs of SAM/SGD on the shared φ (h_i fixed) per round; full-model variants use local-epochs.", _positive, "> 0", section="dp2-fedsam"),
    Key("dp2-lr-head", float, 0.1, "η_h: head learning rate (decayed by lr-decay per round); φ and full models use lr.", _positive, "> 0", section="dp2-fedsam"),
    Key("sam-rho", float, 0.1, "SAM perturbation radius q (Eq. 11).", _nonneg, ">= 0", section="dp2-fedsam"),
    Key("sam-adaptive", bool, False, "Use ASAM (Kwon et al. 2021): perturbation scaled by |w| + sam-eta.", section="dp2-fedsam"),
    Key("sam-eta", float, 0.01, "ASAM η in T_w = |w| + η.", _positive, "> 0", section="dp2-fedsam"),
    Key("ft-epochs", int, 1, "FT baselines: local fine-tuning epochs of the global model before evaluation.", _nonneg, ">= 0", section="dp2-fedsam"),
    Key("dp2-eval-every", int, 1, "Federated evaluation every this many rounds (and the last round).", _positive, "> 0", section="dp2-fedsam"),
    Key("dp2-report-norms", bool, False, "Clients report their pre-clip ‖Δ_i‖ (Fig. 5 diagnostic; NOT privatized, leaks it to the server).", section="dp2-fedsam"),
    # --- robust-hdp: noise-aware aggregation (Robust-HDP, WeiAvg, PFA, min-eps) --------
    Key("rpca-tol", float, 1e-4, "Robust PCA stops when ‖M − L − S‖_F ≤ rpca-tol · ‖M‖_F (Lin et al. 2010); 1e-4 moves the weights < 0.1 % from a 1e-9 solve.", _positive, "> 0", section="robust-hdp"),
    Key("rpca-max-iter", int, 500, "Robust PCA iteration cap (inexact ALM).", _positive, "> 0", section="robust-hdp"),
    Key("rpca-svd", str, "gram", "Thin SVD of the p × n iterate: gram (n × n XᵀX, fastest) or qr (R factor, more accurate).", choices=("gram", "qr"), section="robust-hdp"),
    Key("rpca-backend", str, "numpy", "Robust PCA backend: numpy or torch.", choices=("numpy", "torch"), section="robust-hdp"),
    Key("rpca-device", str, "cpu", "Device of the torch RPCA backend: cpu or cuda.", choices=("cpu", "cuda"), section="robust-hdp"),
    Key("rpca-float32", bool, True, "Run Robust PCA in float32 (half the memory traffic of float64; keep rpca-tol >= 1e-6).", section="robust-hdp"),
    Key("rpca-chunk-rows", int, 0, "Robust-HDP Sec. 3.6: RPCA on blocks of p' rows (0 = the whole p × n matrix).", _nonneg, ">= 0", section="robust-hdp"),
    Key("rpca-chunks", int, 0, "Sec. 3.6: number Q of row blocks used, from the top (0 = all ⌊p/p'⌋; 1 = first block only).", _nonneg, ">= 0", section="robust-hdp"),
    Key("robust-hdp-freeze-weights", bool, False, "Robust-HDP weights from the first round, then frozen (published code); false = recomputed every round (Algorithm 1).", section="robust-hdp"),
    Key("pfa-components", int, 1, "PFA: dimension k of the public principal subspace private updates are projected on.", _positive, "> 0", section="robust-hdp"),
    # --- soteriafl: local DP with shifted compression (SoteriaFL, CDP-SGD, LDP-SGD, LDP-SVRG) ---
    Key("nonconvex-lambda", float, 0.0, "λ of the nonconvex regularizer λ Σ x_j²/(1 + x_j²) of the logreg model (SoteriaFL Sec. 6.1: 0.2).", _nonneg, ">= 0", section="soteriafl"),
    Key("soteriafl-eta", float, 0.3, "SoteriaFL family: server step size η in x ← x − η v (Sec. 6 grid {0.01, ..., 1}).", _positive, "> 0", section="soteriafl"),
    Key("soteriafl-k", int, 0, "Random-k sparsification: coordinates sent per round (0 = ⌊d/20⌋, Sec. 6).", _nonneg, ">= 0", section="soteriafl"),
    Key("soteriafl-gamma", float, 0.0, "Shift step γ (0 = theory sqrt((1+2ω)/(2(1+ω)³))).", _nonneg, ">= 0", section="soteriafl"),
    Key("soteriafl-batch-size", int, 0, "Minibatch b (expected Poisson size; 0 = Corollary 1/2/3 rule: SGD formula, SVRG m^(2/3)/4, SAGA 3m^(2/3)).", _nonneg, ">= 0", section="soteriafl"),
    Key("soteriafl-snapshot-prob", float, 0.0, "SVRG snapshot refresh probability p (0 = b/m, Corollary 2).", lambda v: 0 <= v <= 1, "in [0, 1]", section="soteriafl"),
    Key("soteriafl-utility", bool, True, "Server computes ‖∇f(x_t)‖² and the training loss on the full training data each round (diagnostic).", section="soteriafl"),
    # --- deployment: checkpoint/resume, faults, minimum clients -------------------------
    Key("resume-from", str, "", "Checkpoint (checkpoint.npz or its run folder) to continue; the resumed run writes a new folder with the full ledger.", section="deployment"),
    Key("checkpoint-every", int, 1, "Write checkpoint.npz (atomic) every this many rounds and after the last (0 = never).", _nonneg, ">= 0", section="deployment"),
    Key("client-state-dir", str, "", "Folder where clients journal their Context.state (accountants, shifts, heads) per run lineage and round, so a resumed run continues from the last committed round ('' = <output-dir>/.client-state).", section="deployment"),
    Key("fault-fraction", float, 0.0, "Fraction of clients that fail each round (chosen by seed and round; fault injection for tests).", _fraction, "in [0, 1)", section="deployment"),
    Key("fault-mode", str, "raise", "How an injected fault fails: raise (exception before training) or timeout (sleep fault-delay, then train).", choices=("raise", "timeout"), section="deployment"),
    Key("fault-delay", float, 30.0, "Seconds a timing-out client sleeps (set above round-timeout).", _positive, "> 0", section="deployment"),
    Key("round-timeout", float, 0.0, "Seconds the server waits for client replies each round: 0 = no timeout, else at least 1 (a reply needs a message round trip and local training, so a shorter timeout fails every round; it is most likely milliseconds given for seconds).", lambda v: v == 0 or v >= MIN_ROUND_TIMEOUT_S, f"0 (no timeout) or >= {MIN_ROUND_TIMEOUT_S:g} s", section="deployment"),
    Key("min-fit-clients", int, 0, "Fewest acceptable updates a round needs; fewer aborts the run with a clear message (0 = no minimum).", _nonneg, ">= 0", section="deployment"),
    Key("lifetime-budget", bool, False, "Clients keep the ε of every run in their state folder and refuse once earlier runs plus this one would exceed their budget (basic composition across runs; always on for SuperNodes given a node-config state-dir).", section="deployment"),
    Key("strike-limit", int, 3, "Rejected updates after which a client is excluded from later rounds (0 = never exclude).", _nonneg, ">= 0", section="deployment"),
    Key("robust-norm-factor", float, 10.0, "Strategies without a declared update-norm bound reject an update above this multiple of the median norm of the round's other updates (0 = off).", _nonneg, ">= 0", section="deployment"),
]

SCHEMA: dict[str, Key] = {k.name: k for k in _KEYS}


def _coerce(key: Key, value: Any) -> Any:
    if key.type is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "1", "0"):
            return value.lower() in ("true", "1")
        raise ConfigError(f"run-config {key.name!r} expects true/false, got {value!r}")
    if key.type is int:
        if isinstance(value, bool):
            raise ConfigError(f"run-config {key.name!r} expects an integer, got {value!r}")
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                return int(value.strip())
            except ValueError:
                pass
        raise ConfigError(f"run-config {key.name!r} expects an integer, got {value!r}")
    if key.type is float:
        if isinstance(value, bool):
            raise ConfigError(f"run-config {key.name!r} expects a number, got {value!r}")
        try:
            out = float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"run-config {key.name!r} expects a number, got {value!r}") from None
        if not math.isfinite(out):
            raise ConfigError(f"run-config {key.name!r} must be finite, got {value!r}")
        return out
    if not isinstance(value, str):
        raise ConfigError(f"run-config {key.name!r} expects a string, got {value!r}")
    return value


def check_value(key: Key, value: Any) -> Any:
    value = _coerce(key, value)
    open_value = bool(key.prefix) and value.startswith(key.prefix) and len(value) > len(key.prefix)
    if key.choices is not None and value not in key.choices and not open_value:
        extra = f" or {key.prefix}..." if key.prefix else ""
        raise ConfigError(f"run-config {key.name!r} = {value!r} is not one of {list(key.choices)}{extra}")
    if key.check is not None and not key.check(value):
        raise ConfigError(f"run-config {key.name!r} = {value!r} is invalid: must be {key.expect}")
    return value


def parse_int_list(name: str, text: str) -> list[int]:
    try:
        values = [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise ConfigError(f"run-config {name!r} = {text!r} must be comma-separated integers") from None
    if not values or any(v <= 0 for v in values):
        raise ConfigError(f"run-config {name!r} = {text!r} must list positive integers")
    return values


class RunConfig(dict):
    """A validated run configuration (a plain dict of key → typed value)."""

    @property
    def rounds(self) -> int:
        return int(self["num-server-rounds"])

    @property
    def dp_rounds(self) -> int:
        return int(self["dp-rounds"]) or int(self["num-server-rounds"])


def resolve_config(run_config: Mapping[str, Any] | None = None, overrides: Mapping[str, Any] | None = None) -> RunConfig:
    """Merge ``run_config`` and ``overrides`` over the schema defaults and validate all values."""
    merged: dict[str, Any] = {name: key.default for name, key in SCHEMA.items()}
    for source in (run_config or {}, overrides or {}):
        for name, value in source.items():
            if name not in SCHEMA:
                raise ConfigError(f"unknown run-config key {name!r}; see the README's config reference")
            merged[name] = value
    cfg = RunConfig({name: check_value(SCHEMA[name], value) for name, value in merged.items()})
    validate_cross_fields(cfg)
    return cfg


def validate_cross_fields(cfg: RunConfig) -> None:
    """Checks that involve several keys or the filesystem (no training, no writes)."""
    from fedapp.registry import get_spec

    get_spec(cfg["strategy"])  # raises ConfigError listing valid names
    parse_int_list("batch-size-choices", cfg["batch-size-choices"])
    out = cfg["output-dir"]
    if out and os.path.exists(out) and not os.path.isdir(out):
        raise ConfigError(f"run-config 'output-dir' = {out!r} exists and is not a folder")
    if cfg["device"] == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise ConfigError("run-config 'device' = 'cuda' but no CUDA device is available here (use 'auto' or 'cpu')")
    if cfg["model"] != "auto":
        from fedapp.models.catalog import MODEL_NAMES

        if cfg["model"] not in MODEL_NAMES:
            raise ConfigError(f"run-config 'model' = {cfg['model']!r} is not one of {sorted(MODEL_NAMES)}")
    model = cfg["model"]
    if model == "auto" and cfg["dataset"] in DATASETS:
        from fedapp.models.catalog import DEFAULT_MODEL

        model = DEFAULT_MODEL[cfg["dataset"]]
    if model != "auto" and cfg["dataset"] in DATASETS:  # before any data: hf: shapes are checked once loaded (build_model)
        from fedapp.models.catalog import INPUT_SHAPES, model_input_problem

        shape = INPUT_SHAPES[cfg["dataset"]]
        problem = model_input_problem(model, shape)
        if problem is not None:
            raise ConfigError(f"run-config 'model' = {model!r} does not fit dataset {cfg['dataset']!r}, whose inputs have "
                              f"shape {shape}: {problem}; pick a model that takes them (model = 'auto' picks "
                              "the dataset's default)")
    if cfg["dataset"].startswith("hf:"):
        if cfg["model"] == "auto":
            raise ConfigError(f"dataset {cfg['dataset']!r} has no default model: set run-config 'model'")
        if cfg["data-dir"] and not os.path.isdir(cfg["data-dir"]):
            raise ConfigError(f"run-config 'data-dir' = {cfg['data-dir']!r} is not a folder (dataset {cfg['dataset']!r})")
    elif cfg["dataset"] != "digits":
        data_dir = cfg["data-dir"]
        if not data_dir:
            raise ConfigError(f"dataset {cfg['dataset']!r} needs run-config 'data-dir' (a readable folder), got ''")
        if not os.path.isdir(data_dir) or not os.access(data_dir, os.R_OK):
            raise ConfigError(f"run-config 'data-dir' = {data_dir!r} is not a readable folder (dataset {cfg['dataset']!r})")
    if model != "auto" and cfg["grad-sample-mode"] != "auto":
        from fedapp.models.catalog import check_grad_sample_mode

        try:
            check_grad_sample_mode(model, cfg["grad-sample-mode"])
        except ValueError as exc:
            raise ConfigError(f"run-config 'grad-sample-mode' = {cfg['grad-sample-mode']!r}: {exc}") from None
    if 0 < cfg["num-clients"] < 2:
        raise ConfigError(f"run-config 'num-clients' = {cfg['num-clients']} is too small: a federation needs at least 2 clients")
    if cfg["num-clients"]:
        check_federation_size(cfg, cfg["num-clients"], f"run-config 'num-clients' = {cfg['num-clients']}")
    if cfg["dp-rounds"] and cfg["dp-rounds"] < 1:
        raise ConfigError(f"run-config 'dp-rounds' = {cfg['dp-rounds']} must be >= 1")
    check_secure_sum(cfg)
    ignored = ignored_keys(cfg)
    if ignored:
        raise ConfigError("; ".join(f"run-config {name!r} = {cfg[name]!r} would have no effect: {why}"
                                    for name, why in ignored.items()))


def check_secure_sum(cfg: Mapping[str, Any]) -> None:
    """The distributed discrete Gaussian is charged as an RDP bound without amplification by sampling: refuse the
    settings that would claim more (a PRV composition of that bound, or the release adversary's amplified ε)."""
    from fedapp.registry import get_spec

    if not (get_spec(cfg["strategy"]).privacy.startswith("client-level") and cfg["secure-aggregation"]
            and cfg["secagg-mechanism"] == "ddg"):
        return
    if cfg["accountant"] != "rdp":
        raise ConfigError(f"run-config 'accountant' = {cfg['accountant']!r} with secagg-mechanism = 'ddg': the "
                          "distributed discrete Gaussian's privacy is a Rényi DP bound (Kairouz et al., Prop. 14), "
                          "composed by the rdp accountant only; set accountant = 'rdp' or secagg-mechanism = 'gaussian'")
    if cfg["client-dp-adversary"] != "server":
        raise ConfigError(f"run-config 'client-dp-adversary' = {cfg['client-dp-adversary']!r} with secagg-mechanism = "
                          "'ddg': amplification by sampling is analysed here for the continuous Gaussian only; set "
                          "client-dp-adversary = 'server' or secagg-mechanism = 'gaussian'")


def check_federation_size(cfg: Mapping[str, Any], num_clients: int, source: str = "") -> None:
    """Keys that count or name clients must fit a federation of ``num_clients``; ``source`` says where that number
    comes from in the message ('num-clients', the launcher's --num-supernodes; '' = the clients of the run)."""
    n = int(num_clients)
    where = f" ({source})" if source else ""
    r = int(cfg["clients-per-round"])
    if r > n:
        raise ConfigError(f"run-config 'clients-per-round' = {r} exceeds the {n} clients of this federation{where}: "
                          f"every round would sample all {n} (q = 1) instead; set it to at most {n} (0 = every client "
                          "every round)")
    falsify = int(cfg["falsify-client"])
    if falsify >= n:
        raise ConfigError(f"run-config 'falsify-client' = {falsify} is not a client of this federation{where}: "
                          f"partition ids are 0..{n - 1} (-1 = no client falsifies its ε)")


#: run-config sections each strategy family reads (``Key.section``); keys of other sections are ignored by it
FAMILY_SECTIONS: dict[str, frozenset[str]] = {
    "foundation": frozenset({"general", "data", "privacy", "deployment"}),
    "robust-hdp": frozenset({"general", "data", "privacy", "robust-hdp", "deployment"}),
    "soteriafl": frozenset({"general", "data", "privacy", "soteriafl", "deployment"}),
    "fed-smp": frozenset({"general", "data", "privacy", "fed-smp", "deployment"}),
    "dp2-fedsam": frozenset({"general", "data", "privacy", "fed-smp", "dp2-fedsam", "deployment"}),
}
#: record-level keys a client-level family never reads, and Fed-SMP keys DP2-FedSAM never reads
_CLIENT_LEVEL_IGNORES = frozenset({"privacy-dist", "epsilon-floor", "delta", "falsify-client", "falsify-epsilon",
                                   "grad-sample-mode", "batch-size-choices", "record-neighbours"})
_FAMILY_IGNORES: dict[str, frozenset[str]] = {
    "fed-smp": _CLIENT_LEVEL_IGNORES | {"epsilon"},
    "dp2-fedsam": _CLIENT_LEVEL_IGNORES | {"epsilon", "compression-ratio", "local-steps", "public-samples",
                                           "public-steps"},
    "soteriafl": frozenset({"grad-sample-mode", "local-epochs", "lr", "momentum", "lr-decay", "batch-size",
                            "batch-size-choices"}),
}


def unused_keys(cfg: Mapping[str, Any], family: str) -> list[str]:
    """Keys set to a non-default value that the strategy family ``family`` does not read."""
    sections = FAMILY_SECTIONS.get(family)
    if sections is None:
        return []
    ignored = _FAMILY_IGNORES.get(family, frozenset())
    return [name for name, key in SCHEMA.items()
            if name in cfg and cfg[name] != key.default and (key.section not in sections or name in ignored)]


@dataclass(frozen=True)
class _ReadWhen:
    """Key ``name`` is read only when ``read(cfg)``; otherwise ``why(cfg)`` says why not and how to make it count."""

    name: str
    read: Callable[[Mapping[str, Any]], bool]
    why: Callable[[Mapping[str, Any]], str]
    record_level: bool = False  # the rule is about record-level DP strategies (their per-client ε_i profiles)


#: keys that other values of the same run-config switch off (independent of the strategy family's sections)
_READ_WHEN: tuple[_ReadWhen, ...] = (
    _ReadWhen("epsilon", lambda c: c["privacy-dist"] == "fixed",
              lambda c: f"privacy-dist = {c['privacy-dist']!r} draws each client's ε_i from a distribution and ignores "
                        "'epsilon'; set privacy-dist = 'fixed' to give every client this ε (or leave 'epsilon' out)",
              record_level=True),
    _ReadWhen("epsilon-floor", lambda c: c["privacy-dist"] != "fixed",
              lambda c: "privacy-dist = 'fixed' draws no ε_i, so there is nothing to floor; the floor applies to "
                        "privacy-dist = dist1..dist9", record_level=True),
    _ReadWhen("falsify-epsilon", lambda c: c["falsify-client"] >= 0,
              lambda c: "falsify-client = -1: no client reports a falsified ε; set falsify-client to a partition id",
              record_level=True),
    _ReadWhen("batch-size-choices", lambda c: c["batch-size"] == 0,
              lambda c: f"batch-size = {c['batch-size']} fixes every client's batch size; set batch-size = 0 to draw "
                        "each b_i from batch-size-choices"),
    _ReadWhen("shards-per-client", lambda c: c["partitioner"] == "shards",
              lambda c: f"partitioner = {c['partitioner']!r} does not cut shards; it applies to partitioner = 'shards'"),
    _ReadWhen("classes-per-client", lambda c: c["partitioner"] == "pathological",
              lambda c: f"partitioner = {c['partitioner']!r} does not read it; it applies to partitioner = "
                        "'pathological'"),
    _ReadWhen("dirichlet-alpha", lambda c: c["partitioner"] == "dirichlet",
              lambda c: f"partitioner = {c['partitioner']!r} does not read it; it applies to partitioner = 'dirichlet'"),
    _ReadWhen("fault-mode", lambda c: c["fault-fraction"] > 0,
              lambda c: "fault-fraction = 0 injects no fault; set fault-fraction > 0"),
    _ReadWhen("fault-delay", lambda c: c["fault-fraction"] > 0 and c["fault-mode"] == "timeout",
              lambda c: "only an injected timeout sleeps (fault-fraction > 0 and fault-mode = 'timeout'); here "
                        f"fault-fraction = {c['fault-fraction']!r}, fault-mode = {c['fault-mode']!r}"),
    _ReadWhen("target-epsilon", lambda c: c["noise-multiplier"] == 0,
              lambda c: f"noise-multiplier = {c['noise-multiplier']!r} sets σ directly; set noise-multiplier = 0 to "
                        "calibrate σ to target-epsilon"),
    _ReadWhen("secagg-num-shares", lambda c: bool(c["secure-aggregation"]),
              lambda c: "secure-aggregation = false runs no SecAgg+; set secure-aggregation = true"),
    _ReadWhen("secagg-threshold", lambda c: bool(c["secure-aggregation"]),
              lambda c: "secure-aggregation = false runs no SecAgg+; set secure-aggregation = true"),
    _ReadWhen("secagg-mechanism", lambda c: bool(c["secure-aggregation"]),
              lambda c: "secure-aggregation = false runs no SecAgg+: each client adds continuous Gaussian noise; set "
                        "secure-aggregation = true"),
    _ReadWhen("secagg-bits", lambda c: bool(c["secure-aggregation"]) and c["secagg-mechanism"] == "ddg",
              lambda c: "only the distributed discrete Gaussian has a bit width (secure-aggregation = true and "
                        f"secagg-mechanism = 'ddg'); here secure-aggregation = {str(c['secure-aggregation']).lower()}, "
                        f"secagg-mechanism = {c['secagg-mechanism']!r}"),
    _ReadWhen("sam-eta", lambda c: bool(c["sam-adaptive"]),
              lambda c: "sam-adaptive = false runs plain SAM, which has no η; set sam-adaptive = true (ASAM)"),
    _ReadWhen("rpca-chunks", lambda c: c["rpca-chunk-rows"] > 0,
              lambda c: "rpca-chunk-rows = 0 runs Robust PCA on one block; set rpca-chunk-rows > 0 to cut blocks"),
    _ReadWhen("rpca-device", lambda c: c["rpca-backend"] == "torch",
              lambda c: f"rpca-backend = {c['rpca-backend']!r} runs on the CPU; set rpca-backend = 'torch'"),
)


def ignored_keys(cfg: Mapping[str, Any]) -> dict[str, str]:
    """Keys set to a non-default value that this run-config itself switches off (``epsilon`` under a drawn
    ``privacy-dist``, a partitioner's option under another partitioner …), each with why and how to make it count.

    :func:`resolve_config` refuses them: nothing reports a key that the run silently ignores. Keys a whole strategy
    family does not read are :func:`unused_keys` (a warning: one shared run-config may serve several families)."""
    from fedapp.registry import get_spec

    spec = get_spec(cfg["strategy"])
    family_unused = set(unused_keys(cfg, spec.family))
    record_level = spec.privacy.startswith("record-level")
    return {rule.name: rule.why(cfg) for rule in _READ_WHEN
            if rule.name in cfg and cfg[rule.name] != SCHEMA[rule.name].default and rule.name not in family_unused
            and (record_level or not rule.record_level) and not rule.read(cfg)}


def markdown_table() -> str:
    """The README's config reference, generated from the schema."""
    lines = ["| key | default | meaning |", "|---|---|---|"]
    for section in dict.fromkeys(k.section for k in SCHEMA.values()):
        for key in SCHEMA.values():
            if key.section == section:
                doc = key.doc + (f" One of: {', '.join(key.choices)}." if key.choices and len(key.choices) > 3 else "")
                lines.append(f"| `{key.name}` | `{key.default!r}` | {doc} |")
    return "\n".join(lines)


TABLE_START, TABLE_END = "<!-- config-table:start -->", "<!-- config-table:end -->"
#: the generated reference (``python -m fedapp.config --write-docs``)
CONFIG_DOC = "docs/config.md"


def doc_with_table(doc: str) -> str:
    """``doc`` with the generated config table between the markers."""
    head, _, rest = doc.partition(TABLE_START)
    _, _, tail = rest.partition(TABLE_END)
    return f"{head}{TABLE_START}\n{markdown_table()}\n{TABLE_END}{tail}"


if __name__ == "__main__":
    import sys
    from pathlib import Path

    if "--write-docs" in sys.argv:
        path = Path(__file__).resolve().parents[1] / CONFIG_DOC
        path.write_text(doc_with_table(path.read_text(encoding="utf-8")), encoding="utf-8")
    else:
        print(markdown_table())
