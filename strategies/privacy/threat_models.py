"""The one-line threat model of every strategy (README, ``config.json``, registry): what is protected
(record- vs client-level), where the noise is added (local vs central) and whom it protects against.

One constant per model, used by the strategy classes and the registry alike; docs/privacy.md expands them.
"""

from __future__ import annotations

from enum import StrEnum


class Level(StrEnum):
    """What one guarantee protects: nothing, one record of a client's data, or one client's whole contribution."""

    NONE = "none"
    RECORD = "record-level"
    CLIENT = "client-level"


class ThreatModel(StrEnum):
    """A strategy's threat model; its value is the one-line text ``config.json`` and the README show, its
    :attr:`level` what the code branches on."""

    NONE = "none: non-private baseline"
    NONE_SPARSIFIED = "none: non-private baseline (sparsified + clipped updates, no noise)"
    RECORD_LOCAL_DPSGD = ("record-level local DP: DP-SGD on each client with its own (ε_i, δ_i) before anything "
                          "leaves it; untrusted server")
    RECORD_LOCAL_MIN_EPS = ("record-level local DP: DP-SGD on every client at the federation's minimum ε; untrusted "
                            "server")
    RECORD_LOCAL_SOTERIAFL = ("record-level local DP: each client clips per-sample gradients to G and adds Gaussian "
                              "noise before (shifted) compression; untrusted server")
    CLIENT_LEVEL_LOCAL_NOISE = ("client-level DP: each sampled client clips its update to C and adds N(0, C²σ²/r); "
                                "σ protects the sum of r updates (secure aggregation), σ/√r a single update")
    CLIENT_LEVEL_PERSONALIZED = ("client-level DP: each sampled client clips its update to C and adds N(0, C²σ²/r); "
                                 "σ protects the sum of r updates (secure aggregation), σ/√r a single update; "
                                 "personal heads and fine-tuned models never leave the client")
    CLIENT_LEVEL_FTRL = ("client-level DP, DP-FTRL: clipped updates plus correlated noise (C⁻¹Z)_t from a tree or "
                         "banded matrix factorization, no sampling assumption; under SecAgg+ each client adds its own "
                         "stream (ε against the server), without it the server adds the noise (trusted server; ε "
                         "against observers of the release only)")

    @property
    def level(self) -> Level:
        return _LEVELS[self]


_LEVELS: dict[ThreatModel, Level] = {
    ThreatModel.NONE: Level.NONE, ThreatModel.NONE_SPARSIFIED: Level.NONE,
    ThreatModel.RECORD_LOCAL_DPSGD: Level.RECORD, ThreatModel.RECORD_LOCAL_MIN_EPS: Level.RECORD,
    ThreatModel.RECORD_LOCAL_SOTERIAFL: Level.RECORD,
    ThreatModel.CLIENT_LEVEL_LOCAL_NOISE: Level.CLIENT, ThreatModel.CLIENT_LEVEL_PERSONALIZED: Level.CLIENT,
    ThreatModel.CLIENT_LEVEL_FTRL: Level.CLIENT,
}


NONE = ThreatModel.NONE
NONE_SPARSIFIED = ThreatModel.NONE_SPARSIFIED
RECORD_LOCAL_DPSGD = ThreatModel.RECORD_LOCAL_DPSGD
RECORD_LOCAL_MIN_EPS = ThreatModel.RECORD_LOCAL_MIN_EPS
RECORD_LOCAL_SOTERIAFL = ThreatModel.RECORD_LOCAL_SOTERIAFL
CLIENT_LEVEL_LOCAL_NOISE = ThreatModel.CLIENT_LEVEL_LOCAL_NOISE
CLIENT_LEVEL_PERSONALIZED = ThreatModel.CLIENT_LEVEL_PERSONALIZED
CLIENT_LEVEL_FTRL = ThreatModel.CLIENT_LEVEL_FTRL
#: what ``epsilon_vs_server`` does not prove under SecAgg+ with continuous Gaussian shares (``secagg-mechanism =
#: 'gaussian'``: the DP-FTRL streams, adaptive clipping, the release adversary): the ε is the continuous Gaussian's,
#: but the server sees the shares after Flower's quantizer rounded them and reduced their sum modulo the field
ROUNDED_SUM_CAVEAT = ("not proven: the continuous Gaussian shares are rounded by Flower's SecAgg+ quantizer and summed "
                      "modulo its field; the epsilon is the continuous Gaussian's, and no analysis of that rounded "
                      "modular sum bounds what the server sees (secagg-mechanism = 'ddg' is the proven integer "
                      "mechanism)")
