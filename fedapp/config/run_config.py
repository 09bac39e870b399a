"""The resolved run-config: :class:`RunConfig`, built once per process by :func:`resolve_config`.

Flower passes ``[tool.flwr.app.config]`` (overridable with ``flwr run --run-config``) as a flat mapping.
:func:`resolve_config` merges it over the defaults, coerces types and validates every value, and the checks
that span keys, *before* any training starts or any results folder is created.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from fedapp.config.keys import (
    DATASETS,
    NODE_LOCAL,
    check_value,
    is_user_dataset,
    parse_input_shape,
    parse_int_list,
)
from fedapp.config.schema import SCHEMA
from fedapp.config.sections import (
    SECTION_CLASSES,
    ClientDPConfig,
    DataConfig,
    DeploymentConfig,
    DP2FedSAMConfig,
    GeneralConfig,
    RobustHDPConfig,
    SoteriaFLConfig,
    TrainingConfig,
)
from fedapp.models.catalog import DEFAULT_MODEL, ModelSpec
from fedapp.registry import REGISTRY, Family, Feature, get_spec, registry_version
from strategies.errors import ConfigError
from strategies.privacy.threat_models import Level


@dataclass(frozen=True, eq=False)
class RunConfig(Mapping[str, Any]):
    """A validated run-config: one frozen dataclass per concern (``cfg.data.partitioner``).

    It is also a read-only mapping by run-config name (``cfg["partitioner"]``, ``dict(cfg)``), the form
    results folders and checkpoints store."""

    general: GeneralConfig = field(default_factory=GeneralConfig)
    data: DataConfig = field(default_factory=DataConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    client_dp: ClientDPConfig = field(default_factory=ClientDPConfig)
    dp2_fedsam: DP2FedSAMConfig = field(default_factory=DP2FedSAMConfig)
    robust_hdp: RobustHDPConfig = field(default_factory=RobustHDPConfig)
    soteriafl: SoteriaFLConfig = field(default_factory=SoteriaFLConfig)
    deployment: DeploymentConfig = field(default_factory=DeploymentConfig)
    #: the sections registered families bring (``Family.config``), by attribute: ``cfg.<attr>`` reads them too
    extra: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def from_values(cls, values: Mapping[str, Any]) -> RunConfig:
        """The config holding ``values`` (checked values by run-config name; missing keys keep their default)."""
        unknown = set(values) - SCHEMA.keys()
        if unknown:
            raise ConfigError(f"unknown run-config key {sorted(unknown)[0]!r}; see docs/config.md")
        classes = SCHEMA.classes()
        grouped: dict[str, dict[str, Any]] = {attr: {} for attr in classes}
        for name, value in values.items():
            grouped[SCHEMA[name].attr][name.replace("-", "_")] = value
        built: dict[str, Any] = {attr: classes[attr](**kw) for attr, kw in grouped.items() if attr in SECTION_CLASSES}
        extra = {attr: classes[attr](**kw) for attr, kw in grouped.items() if attr not in SECTION_CLASSES}
        return cls(**built, extra=extra)

    def __getattr__(self, name: str) -> Any:
        """A registered family's own section (``cfg.<attr>``)."""
        if name.startswith("_") or name == "extra":
            raise AttributeError(name)
        try:
            return self.extra[name]
        except KeyError:
            raise AttributeError(f"RunConfig has no section {name!r}") from None

    def __getitem__(self, name: str) -> Any:
        key = SCHEMA.get(name)
        if key is None:
            raise KeyError(name)
        return getattr(getattr(self, key.attr), name.replace("-", "_"))

    def __iter__(self) -> Iterator[str]:
        return iter(SCHEMA)

    def __len__(self) -> int:
        return len(SCHEMA)

    def __repr__(self) -> str:
        changed = {k: v for k, v in self.items() if v != SCHEMA[k].default}
        return f"RunConfig({changed!r})"

    @property
    def rounds(self) -> int:
        return self.general.num_server_rounds

    @property
    def dp_rounds(self) -> int:
        return self.training.dp_rounds or self.general.num_server_rounds

    @property
    def model_spec(self) -> ModelSpec:
        """The run's model (``model``, ``auto`` → the dataset's default; ``seed``; ``nonconvex-lambda``)."""
        name = self.general.model if self.general.model != "auto" else DEFAULT_MODEL[self.data.dataset]
        return ModelSpec(name, self.general.seed, self.soteriafl.nonconvex_lambda)

    def sections_for(self, fn: Callable[..., Any]) -> dict[str, Any]:
        """The sections ``fn`` declares by parameter name (``general``, ``data``, ``training``, ``client_dp``,
        ``robust_hdp``, ``soteriafl``, ``dp2_fedsam``, ``deployment``, a registered family's own section, and
        ``model_spec``): how a composition root hands a builder what it reads and nothing more."""
        params = inspect.signature(fn).parameters
        out: dict[str, Any] = {name: getattr(self, name) for name in SCHEMA.classes() if name in params}
        if "model_spec" in params:
            out["model_spec"] = self.model_spec
        return out


def _freeze(mapping: Mapping[str, Any] | None) -> tuple[tuple[str, str, str], ...]:
    return tuple(sorted((str(k), type(v).__name__, repr(v)) for k, v in (mapping or {}).items()))


def resolve_config(run_config: Mapping[str, Any] | None = None, overrides: Mapping[str, Any] | None = None) -> RunConfig:
    """Merge ``run_config`` and ``overrides`` over the defaults and validate all values.

    The result is computed once per process for each distinct input (a ClientApp resolves the same Flower
    run-config for every message), so the checks that touch the filesystem or probe CUDA run once."""
    if isinstance(run_config, RunConfig) and not overrides:
        return run_config  # already resolved and validated
    memo_key = (_freeze(run_config), _freeze(overrides), registry_version())
    cached = _CACHE.get(memo_key)
    if cached is not None:
        return cached
    merged: dict[str, Any] = {name: key.default for name, key in SCHEMA.items()}
    for source in (run_config or {}, overrides or {}):
        for name, value in source.items():
            if name not in SCHEMA:
                raise ConfigError(f"unknown run-config key {name!r}; see docs/config.md")
            merged[name] = value
    resolve_defaults(merged)
    cfg = RunConfig.from_values({name: check_value(SCHEMA[name], value) for name, value in merged.items()})
    validate_cross_fields(cfg)
    if len(_CACHE) >= _CACHE_SIZE:
        _CACHE.pop(next(iter(_CACHE)))
    _CACHE[memo_key] = cfg
    return cfg


_CACHE: dict[tuple[Any, ...], RunConfig] = {}
_CACHE_SIZE = 64


def check_user_model(cfg: RunConfig) -> None:
    """A user's ``model = "module.path:factory"``, before any process starts: importable, an ``nn.Module`` for the
    dataset's inputs whose dummy batch gives (2, num_classes) logits, accepted by Opacus' ``ModuleValidator`` for the
    DP-SGD families, and with the personal head ``dp2-head`` names for the DP2-FedSAM family. Datasets whose shapes
    are known only once loaded (``hf:``) are checked by the import alone here, the rest when the model is built."""
    from fedapp.models.catalog import INPUT_SHAPES, NUM_CLASSES
    from fedapp.models.user import build_user_model, load_factory, user_model_problem
    spec = cfg["model"]
    shapes = {**INPUT_SHAPES, **({NODE_LOCAL: schema_shape(cfg)} if cfg["dataset"] == NODE_LOCAL else {})}
    counts = {**NUM_CLASSES, NODE_LOCAL: int(cfg["num-classes"])}
    if cfg["dataset"] not in shapes:
        try:
            load_factory(spec)
        except ValueError as exc:
            raise ConfigError(f"run-config 'model' = {spec!r}: {exc}") from None
        return
    shape, classes = shapes[cfg["dataset"]], counts[cfg["dataset"]]
    strategy = get_spec(cfg["strategy"])
    problem = user_model_problem(spec, shape, classes, dp_sgd=strategy.supports(Feature.DPSGD_CLIENTS))
    if problem is not None:
        raise ConfigError(f"run-config 'model' = {spec!r} (inputs {shape}, {classes} classes of dataset "
                          f"{cfg['dataset']!r}): {problem}")
    if strategy.supports(Feature.PERSONAL_HEAD):
        from strategies.dp2_fedsam import head_parameter_names

        try:
            head_parameter_names(build_user_model(spec, shape, classes), cfg["dp2-head"])
        except ValueError as exc:
            raise ConfigError(f"run-config 'dp2-head' = {cfg['dp2-head']!r} with model {spec!r}: {exc}; name the "
                              "personal head's modules (comma-separated parameter-name prefixes)") from None


def resolve_defaults(merged: dict[str, Any]) -> None:
    """Replace the defaults that depend on the rest of the run-config by their values, in place.

    ``secagg-mechanism = 'auto'`` (the default) under SecAgg+ for a client-level strategy: the distributed discrete
    Gaussian where it applies, else continuous Gaussian shares, which the strategy and features that the run turns on
    need (DP-FTRL's correlated streams, adaptive clipping's count coordinate, the release adversary's amplification,
    an accountant other than rdp). A value the user sets is kept, and refused by the checks where it conflicts."""
    if merged.get("secagg-mechanism") != "auto" or not merged.get("secure-aggregation"):
        return
    try:
        spec = get_spec(str(merged["strategy"]))
    except (KeyError, ValueError):
        return  # an unknown strategy is refused by its own check
    if spec.level is not Level.CLIENT:
        return
    needs_gaussian = (not spec.supports(Feature.DDG) or merged.get("adaptive-clip-quantile") not in (0, 0.0)
                      or merged.get("client-dp-adversary") == "release" or merged.get("accountant") != "rdp")
    merged["secagg-mechanism"] = "gaussian" if needs_gaussian else "ddg"


def clear_cache() -> None:
    """Forget resolved configs (tests that change the filesystem or CUDA state under one config)."""
    _CACHE.clear()


def validate_cross_fields(cfg: RunConfig) -> None:
    """Checks that involve several keys or the filesystem (no training, no writes)."""
    get_spec(cfg["strategy"])  # raises ConfigError listing valid names
    parse_int_list("batch-size-choices", cfg["batch-size-choices"])
    out = cfg["output-dir"]
    if out and os.path.exists(out) and not os.path.isdir(out):
        raise ConfigError(f"run-config 'output-dir' = {out!r} exists and is not a folder")
    if cfg["device"] == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise ConfigError("run-config 'device' = 'cuda' but no CUDA device is available here (use 'auto' or 'cpu')")
    from fedapp.models.user import is_user_model

    if cfg["model"] != "auto" and not is_user_model(cfg["model"]):
        from fedapp.models.catalog import MODEL_NAMES

        if cfg["model"] not in MODEL_NAMES:
            raise ConfigError(f"run-config 'model' = {cfg['model']!r} is not one of {sorted(MODEL_NAMES)} nor a "
                              "factory of your own, 'module.path:factory'")
    model = cfg["model"]
    if cfg["dataset"] == NODE_LOCAL:
        check_node_local(cfg)
    if is_user_model(model):
        check_user_model(cfg)
    if model == "auto" and cfg["dataset"] in DATASETS:
        from fedapp.models.catalog import DEFAULT_MODEL

        model = DEFAULT_MODEL[cfg["dataset"]]
    if model != "auto" and not is_user_model(model) and cfg["dataset"] in DATASETS:  # hf: shapes: once loaded
        from fedapp.models.catalog import INPUT_SHAPES, model_input_problem

        shape = INPUT_SHAPES[cfg["dataset"]]
        problem = model_input_problem(model, shape)
        if problem is not None:
            raise ConfigError(f"run-config 'model' = {model!r} does not fit dataset {cfg['dataset']!r}, whose inputs have "
                              f"shape {shape}: {problem}; pick a model that takes them (model = 'auto' picks "
                              "the dataset's default)")
    if cfg["dataset"] == NODE_LOCAL:
        pass  # no data here: each node reads its own (check_node_local checked the schema and the model above)
    elif is_user_dataset(cfg["dataset"]):
        from fedapp.models.user import load_factory

        if cfg["model"] == "auto":
            raise ConfigError(f"dataset {cfg['dataset']!r} (your loader) has no default model: set run-config 'model'")
        try:
            load_factory(cfg["dataset"])
        except ValueError as exc:
            raise ConfigError(f"run-config 'dataset' = {cfg['dataset']!r}: {exc}") from None
    elif cfg["dataset"].startswith("hf:"):
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
    if model != "auto" and not is_user_model(model) and cfg["grad-sample-mode"] != "auto":
        from fedapp.models.catalog import check_grad_sample_mode

        try:
            check_grad_sample_mode(model, cfg["grad-sample-mode"])
        except ValueError as exc:
            raise ConfigError(f"run-config 'grad-sample-mode' = {cfg['grad-sample-mode']!r}: {exc}") from None
    if cfg["cuda-graphs"]:
        if cfg["device"] == "cpu":
            raise ConfigError("run-config 'cuda-graphs' = true replays DP-SGD steps as CUDA graphs, but 'device' = "
                              "'cpu'; set device = 'cuda' (or 'auto' where clients have a GPU), or cuda-graphs = false")
        if cfg["grad-sample-mode"] not in ("auto", "hooks"):
            raise ConfigError(f"run-config 'cuda-graphs' = true captures Opacus' hooks mode, but 'grad-sample-mode' = "
                              f"{cfg['grad-sample-mode']!r}; set grad-sample-mode = 'hooks' or 'auto'")
        import torch

        if not torch.cuda.is_available():  # device = 'cuda' is refused above already
            raise ConfigError("run-config 'cuda-graphs' = true needs a CUDA device, and none is available here (device "
                              "= 'auto' would train on the CPU); set cuda-graphs = false")
    if 0 < cfg["num-clients"] < 2:
        raise ConfigError(f"run-config 'num-clients' = {cfg['num-clients']} is too small: a federation needs at least 2 clients")
    if cfg["num-clients"]:
        check_federation_size(cfg.general, cfg.training, cfg.general.num_clients,
                              f"run-config 'num-clients' = {cfg.general.num_clients}")
    if cfg["dp-rounds"] and cfg["dp-rounds"] < 1:
        raise ConfigError(f"run-config 'dp-rounds' = {cfg['dp-rounds']} must be >= 1")
    check_audit(cfg)
    check_ftrl(cfg)
    check_secure_randomness(cfg)
    check_secure_sum(cfg)
    check_adaptive_clip(cfg)
    ignored = ignored_keys(cfg)
    if ignored:
        raise ConfigError("; ".join(f"run-config {name!r} = {cfg[name]!r} would have no effect: {why}"
                                    for name, why in ignored.items()))


def schema_shape(cfg: Mapping[str, Any]) -> tuple[int, ...]:
    """Run-config ``input-shape`` as a tuple (``()`` when unset; ``ConfigError`` naming the key when malformed)."""
    return parse_input_shape(str(cfg["input-shape"]))


def check_node_local(cfg: Mapping[str, Any]) -> None:
    """``dataset = 'node-local'``: the schema the server builds the model from, a model it can build from it, and no
    feature that needs data on the server (its public set, a central pool)."""
    missing = [k for k, bad in (("input-shape", not schema_shape(cfg)), ("num-classes", cfg["num-classes"] < 2)) if bad]
    if missing:
        raise ConfigError(f"run-config 'dataset' = {NODE_LOCAL!r} needs {' and '.join(repr(k) for k in missing)}: the "
                          "server builds the model from them, since it never sees the nodes' data (e.g. "
                          "input-shape=[16] num-classes=3; num-classes >= 2)")
    if cfg["model"] == "auto":
        raise ConfigError(f"run-config 'dataset' = {NODE_LOCAL!r} has no default model: set run-config 'model' (a "
                          "catalog name or your own 'module.path:factory')")
    from fedapp.models.user import is_user_model

    if not is_user_model(cfg["model"]):
        from fedapp.models.catalog import model_input_problem

        problem = model_input_problem(cfg["model"], schema_shape(cfg))
        if problem is not None:
            raise ConfigError(f"run-config 'model' = {cfg['model']!r} does not fit run-config 'input-shape' = "
                              f"{list(schema_shape(cfg))}: {problem}")
    if get_spec(cfg["strategy"]).supports(Feature.PUBLIC_SET):
        raise ConfigError(f"strategy {cfg['strategy']!r} needs the server's public set (public-samples), which "
                          f"run-config 'dataset' = {NODE_LOCAL!r} does not have: every example stays on its node; "
                          "use a rand-k variant")


def audits_records(strategy: str) -> bool:
    """Whether ``audit-canaries`` of ``strategy`` are canary records in the clients' data (the record-level DP-SGD and
    SoteriaFL families: :mod:`fedapp.privacy.record_audit`) rather than canary clients."""
    return get_spec(strategy).level is Level.RECORD


def record_canaries(general: GeneralConfig) -> int:
    """How many canary records the run adds to its clients' data (0 without a record-level audit)."""
    return general.audit_canaries if general.audit_canaries and audits_records(general.strategy) else 0


def check_audit(cfg: Mapping[str, Any]) -> None:
    """``audit-canaries``: a family that can be audited, in a simulation from its start, at least 2 canaries;
    client-level: at least 2 clients that are not canaries; record-level: the replace-one relation its slots use."""
    k = int(cfg["audit-canaries"])
    if k == 0:
        return
    records = audits_records(cfg["strategy"])
    if get_spec(cfg["strategy"]).level is Level.NONE:
        raise ConfigError(f"run-config 'audit-canaries' = {k} with strategy {cfg['strategy']!r}: canaries exist "
                          "for the client-level strategies (canary clients) and the record-level ones (canary records); "
                          "a non-private strategy has no guarantee to audit; set audit-canaries = 0")
    if cfg["dataset"] == NODE_LOCAL:
        raise ConfigError(f"run-config 'audit-canaries' = {k} with dataset = {NODE_LOCAL!r}: canaries are simulated "
                          "clients or records, and a deployment's nodes hold their own data; audit in a simulation")
    if cfg["resume-from"]:
        raise ConfigError(f"run-config 'audit-canaries' = {k} with 'resume-from': the audit reads every round's model "
                          "from the run's start, which a resumed process never saw; audit a run from its start")
    if k < 2:
        raise ConfigError(f"run-config 'audit-canaries' = {k}: the audit guesses the coins of at least 2 canaries")
    if records:
        if cfg["record-neighbours"] != "replace-one":
            raise ConfigError(f"run-config 'audit-canaries' = {k} with record-neighbours = "
                              f"{cfg['record-neighbours']!r}: a canary slot swaps one record for another, the "
                              "replace-one relation; audit with record-neighbours = 'replace-one'")
        return
    n = int(cfg["num-clients"])
    if n and k > n - 2:
        raise ConfigError(f"run-config 'audit-canaries' = {k} leaves {n - k} of the {n} clients to train; at most "
                          f"{max(n - 2, 0)} canaries (2 clients that train)")


def _supports(cfg: Mapping[str, Any], feature: Feature) -> bool:
    """Whether the run-config's strategy supports ``feature``."""
    return get_spec(cfg["strategy"]).supports(feature)


def check_ftrl(cfg: Mapping[str, Any]) -> None:
    """DP-FTRL's supported settings: who adds the noise decides whom ε holds against, and the distributed discrete
    Gaussian cannot carry correlated noise."""
    if not _supports(cfg, Feature.CORRELATED_NOISE):
        return
    rounds = int(cfg["dp-rounds"] or cfg["num-server-rounds"])
    if cfg["ftrl-mechanism"] == "banded" and cfg["ftrl-bands"] > rounds:
        raise ConfigError(f"run-config 'ftrl-bands' = {cfg['ftrl-bands']} exceeds the {rounds} rounds DP-FTRL is "
                          "planned for (dp-rounds, else num-server-rounds); set it to at most that")
    sep = int(cfg["ftrl-min-separation"])
    if sep > rounds:
        raise ConfigError(f"run-config 'ftrl-min-separation' = {sep} exceeds the {rounds} rounds DP-FTRL is planned for "
                          "(dp-rounds, else num-server-rounds): clients past the first round's turn would never train; "
                          "set it to at most that")
    if sep > 1 and cfg["clients-per-round"] not in (0, cfg["num-clients"]):
        raise ConfigError(f"run-config 'clients-per-round' = {cfg['clients-per-round']} with ftrl-min-separation = "
                          f"{sep}: the public schedule decides who trains in each round and every client takes part in "
                          "every round; set clients-per-round = 0")
    if cfg["secure-aggregation"]:
        if cfg["secagg-mechanism"] != "gaussian":
            raise ConfigError(f"run-config 'secagg-mechanism' = {cfg['secagg-mechanism']!r} with strategy "
                              f"{cfg['strategy']!r}: the distributed discrete Gaussian draws fresh discrete noise "
                              "each round and cannot carry DP-FTRL's correlated stream; set secagg-mechanism = "
                              "'gaussian'")
        if cfg["clients-per-round"] != 0 and cfg["clients-per-round"] != cfg["num-clients"]:
            raise ConfigError(f"run-config 'clients-per-round' = {cfg['clients-per-round']} with strategy "
                              f"{cfg['strategy']!r} under SecAgg+: each client's noise stream must reach every sum, "
                              "so every client takes part in every round; set clients-per-round = 0")
    elif cfg["client-dp-adversary"] != "release":
        raise ConfigError(f"run-config 'client-dp-adversary' = {cfg['client-dp-adversary']!r} with strategy "
                          f"{cfg['strategy']!r} and secure-aggregation = false: the server adds the noise and sees "
                          "every clipped update, so no epsilon holds against it; set secure-aggregation = true (each "
                          "client adds its noise stream) or client-dp-adversary = 'release' (a trusted server)")


def check_adaptive_clip(cfg: Mapping[str, Any]) -> None:
    """Adaptive clipping runs with the strategies that support it (:class:`fedapp.registry.Feature`), without SecAgg+ or under
    SecAgg+ with continuous Gaussian shares (the count share rides in the secure sum): refuse the settings it would
    not serve. dp-ftrl is excluded: its correlated noise's sensitivity is analysed for one fixed clip across rounds,
    and a changing C_t breaks the prefix-sum structure that analysis rests on."""
    quantile = cfg["adaptive-clip-quantile"]
    if quantile == 0:
        return
    if not _supports(cfg, Feature.ADAPTIVE_CLIP):
        supported = [name for name, spec in REGISTRY.items() if spec.supports(Feature.ADAPTIVE_CLIP)]
        raise ConfigError(f"run-config 'adaptive-clip-quantile' = {quantile!r} with strategy {cfg['strategy']!r}: "
                          f"adaptive clipping is supported by strategy in {supported} only"
                          + (" (dp-ftrl's correlated noise has its sensitivity analysed for one fixed clip across "
                             "rounds: a changing C_t breaks the prefix-sum structure)"
                             if _supports(cfg, Feature.CORRELATED_NOISE) else "")
                          + "; set adaptive-clip-quantile = 0 (a fixed clip-norm) or pick a supported strategy")
    if cfg["secure-aggregation"] and cfg["secagg-mechanism"] != "gaussian":
        raise ConfigError(f"run-config 'secagg-mechanism' = {cfg['secagg-mechanism']!r} with adaptive-clip-quantile = "
                          f"{quantile!r}: the distributed discrete Gaussian's privacy bound covers the rotated update "
                          "alone, not the count coordinate adaptive clipping adds to the secure sum; set "
                          "secagg-mechanism = 'gaussian' or adaptive-clip-quantile = 0")


def check_secure_randomness(cfg: Mapping[str, Any]) -> None:
    """``secure-randomness`` needs a family whose noise is drawn through NumPy (client-level, SoteriaFL) and real
    noise: refuse it where it would do nothing or could not be honoured."""
    if not cfg["secure-randomness"]:
        return
    spec = get_spec(cfg["strategy"])
    if cfg["seeded-noise"]:
        raise ConfigError("run-config 'secure-randomness' = true with seeded-noise = true: noise derived from the run "
                          "seed is known to the server whatever generator draws it; set one of them to false")
    if spec.level is Level.NONE:
        raise ConfigError(f"run-config 'secure-randomness' = true with strategy {cfg['strategy']!r}, which adds no "
                          "noise: it would have no effect; set it to false")
    if spec.supports(Feature.DPSGD_CLIENTS):
        raise ConfigError(f"run-config 'secure-randomness' = true with strategy {cfg['strategy']!r}: its DP-SGD "
                          "noise and Poisson batches are drawn by Opacus from torch's generator, and Opacus' secure "
                          "mode needs torchcsprng, which has no build for this torch; set secure-randomness = false")


def check_secure_sum(cfg: Mapping[str, Any]) -> None:
    """The distributed discrete Gaussian is charged as an RDP bound without amplification by sampling: refuse the
    settings that would claim more (a PRV composition of that bound, or the release adversary's amplified ε)."""
    client_level = get_spec(cfg["strategy"]).level is Level.CLIENT
    if (client_level and not _supports(cfg, Feature.CORRELATED_NOISE) and not cfg["secure-aggregation"]
            and cfg["client-dp-adversary"] == "release"):
        raise ConfigError("run-config 'client-dp-adversary' = 'release' with secure-aggregation = false: without "
                          "SecAgg+ every update carries its own fixed noise, so the released mean's noise reveals how "
                          "many clients were sampled and amplification by sampling does not hold (the release would be "
                          "charged unamplified, as against the server); set secure-aggregation = true with "
                          "secagg-mechanism = 'gaussian', or client-dp-adversary = 'server'")
    if not (client_level and cfg["secure-aggregation"] and cfg["secagg-mechanism"] == "ddg"):
        return
    if cfg["accountant"] != "rdp":
        raise ConfigError(f"run-config 'accountant' = {cfg['accountant']!r} with secagg-mechanism = 'ddg': the "
                          "distributed discrete Gaussian's privacy is a Rényi DP bound (Kairouz et al., Prop. 14), "
                          "composed by the rdp accountant only; set accountant = 'rdp' or secagg-mechanism = 'gaussian'")
    if cfg["client-dp-adversary"] != "server":
        raise ConfigError(f"run-config 'client-dp-adversary' = {cfg['client-dp-adversary']!r} with secagg-mechanism = "
                          "'ddg': amplification by sampling is analysed here for the continuous Gaussian only; set "
                          "client-dp-adversary = 'server' or secagg-mechanism = 'gaussian'")


def check_fault_config(deployment: DeploymentConfig) -> None:
    """Cross-field checks of the fault/timeout keys (``ConfigError`` naming the values)."""
    if deployment.fault_fraction > 0 and deployment.fault_mode == "timeout":
        if deployment.round_timeout <= 0:
            raise ConfigError("run-config 'fault-mode' = 'timeout' needs 'round-timeout' > 0 (got "
                              f"{deployment.round_timeout!r}); otherwise the server waits for the late clients")
        if deployment.fault_delay <= deployment.round_timeout:
            raise ConfigError(f"run-config 'fault-delay' = {deployment.fault_delay!r} must exceed 'round-timeout' = "
                              f"{deployment.round_timeout!r} for an injected timeout to be one")


def check_federation_size(general: GeneralConfig, training: TrainingConfig, num_clients: int, source: str = "") -> None:
    """Keys that count or name clients must fit a federation of ``num_clients``; ``source`` says where that number
    comes from in the message ('num-clients', the launcher's --num-supernodes; '' = the clients of the run)."""
    n = int(num_clients)
    where = f" ({source})" if source else ""
    r = general.clients_per_round
    if r > n:
        raise ConfigError(f"run-config 'clients-per-round' = {r} exceeds the {n} clients of this federation{where}: "
                          f"every round would sample all {n} (q = 1) instead; set it to at most {n} (0 = every client "
                          "every round)")
    falsify = training.falsify_client
    if falsify >= n:
        raise ConfigError(f"run-config 'falsify-client' = {falsify} is not a client of this federation{where}: "
                          f"partition ids are 0..{n - 1} (-1 = no client falsifies its ε)")


def unused_keys(cfg: Mapping[str, Any], family: Family) -> list[str]:
    """Keys set to a non-default value that the strategy family ``family`` does not read (its ``sections`` and
    ``ignores``)."""
    return [name for name, key in SCHEMA.items()
            if name in cfg and cfg[name] != key.default and (key.section not in family.sections
                                                             or name in family.ignores)]


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
    _ReadWhen("input-shape", lambda c: c["dataset"] == NODE_LOCAL,
              lambda c: f"dataset = {c['dataset']!r} gives the model its inputs' shape; input-shape applies to "
                        f"dataset = {NODE_LOCAL!r}"),
    _ReadWhen("num-classes", lambda c: c["dataset"] == NODE_LOCAL,
              lambda c: f"dataset = {c['dataset']!r} gives the model its classes; num-classes applies to "
                        f"dataset = {NODE_LOCAL!r}"),
    *(_ReadWhen(name, lambda c: c["dataset"] != NODE_LOCAL,
                lambda c: f"dataset = {NODE_LOCAL!r}: every node trains on its own data (node-config 'data-path', "
                          "split locally); there is no central pool to read, cap or partition")
      for name in ("data-dir", "partitioner", "max-samples", "public-samples")),
    _ReadWhen("shards-per-client", lambda c: c["partitioner"] == "shards",
              lambda c: f"partitioner = {c['partitioner']!r} does not cut shards; it applies to partitioner = 'shards'"),
    _ReadWhen("classes-per-client", lambda c: c["partitioner"] == "pathological",
              lambda c: f"partitioner = {c['partitioner']!r} does not read it; it applies to partitioner = "
                        "'pathological'"),
    _ReadWhen("dirichlet-alpha", lambda c: c["partitioner"] == "dirichlet",
              lambda c: f"partitioner = {c['partitioner']!r} does not read it; it applies to partitioner = 'dirichlet'"),
    _ReadWhen("audit-seed", lambda c: c["audit-canaries"] > 0,
              lambda c: "audit-canaries = 0 inserts no canary; set audit-canaries > 0"),
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
    _ReadWhen("ftrl-mechanism", lambda c: _supports(c, Feature.CORRELATED_NOISE),
              lambda c: f"strategy {c['strategy']!r} adds independent noise; the factorization applies to "
                        f"strategy in {_ftrl_names()}"),
    _ReadWhen("ftrl-bands", lambda c: _supports(c, Feature.CORRELATED_NOISE) and c["ftrl-mechanism"] == "banded",
              lambda c: f"only a banded factorization has bands (strategy in {_ftrl_names()} and "
                        f"ftrl-mechanism = 'banded'); here strategy = {c['strategy']!r}, ftrl-mechanism = "
                        f"{c['ftrl-mechanism']!r}"),
    _ReadWhen("ftrl-restart-every", lambda c: _supports(c, Feature.CORRELATED_NOISE) and c["ftrl-mechanism"] == "tree",
              lambda c: f"only the tree restarts (strategy in {_ftrl_names()} and ftrl-mechanism = 'tree'); "
                        f"here strategy = {c['strategy']!r}, ftrl-mechanism = {c['ftrl-mechanism']!r}"),
    _ReadWhen("ftrl-min-separation", lambda c: _supports(c, Feature.CORRELATED_NOISE),
              lambda c: f"strategy {c['strategy']!r} has no participation schedule; min-separated participation "
                        f"applies to strategy in {_ftrl_names()}"),
    _ReadWhen("adaptive-clip-lr", lambda c: c["adaptive-clip-quantile"] > 0,
              lambda c: "adaptive-clip-quantile = 0 keeps clip-norm fixed; set adaptive-clip-quantile in (0, 1)"),
    _ReadWhen("adaptive-clip-count-noise", lambda c: c["adaptive-clip-quantile"] > 0,
              lambda c: "adaptive-clip-quantile = 0 keeps clip-norm fixed; set adaptive-clip-quantile in (0, 1)"),
    _ReadWhen("sam-eta", lambda c: bool(c["sam-adaptive"]),
              lambda c: "sam-adaptive = false runs plain SAM, which has no η; set sam-adaptive = true (ASAM)"),
    _ReadWhen("rpca-chunks", lambda c: c["rpca-chunk-rows"] > 0,
              lambda c: "rpca-chunk-rows = 0 runs Robust PCA on one block; set rpca-chunk-rows > 0 to cut blocks"),
    _ReadWhen("rpca-device", lambda c: c["rpca-backend"] == "torch",
              lambda c: f"rpca-backend = {c['rpca-backend']!r} runs on the CPU; set rpca-backend = 'torch'"),
)


def _ftrl_names() -> list[str]:
    return [name for name, spec in REGISTRY.items() if spec.supports(Feature.CORRELATED_NOISE)]


def ignored_keys(cfg: Mapping[str, Any]) -> dict[str, str]:
    """Keys set to a non-default value that this run-config itself switches off (``epsilon`` under a drawn
    ``privacy-dist``, a partitioner's option under another partitioner …), each with why and how to make it count.

    :func:`resolve_config` refuses them: nothing reports a key that the run silently ignores. Keys a whole strategy
    family does not read are :func:`unused_keys` (a warning: one shared run-config may serve several families)."""
    spec = get_spec(cfg["strategy"])
    family_unused = set(unused_keys(cfg, spec.family))
    record_level = spec.level is Level.RECORD
    return {rule.name: rule.why(cfg) for rule in _READ_WHEN
            if rule.name in cfg and cfg[rule.name] != SCHEMA[rule.name].default and rule.name not in family_unused
            and (record_level or not rule.record_level) and not rule.read(cfg)}


