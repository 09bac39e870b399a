"""A value the user never set never makes a run fail: defaults follow the strategy and the features turned on, and
a conflicting value the user did set is still refused, naming it."""

from __future__ import annotations

import pytest

from fedapp.config import ConfigError, resolve_config
from fedapp.privacy.profiles import adaptive_clip_config, client_level_mechanism


@pytest.mark.parametrize(("overrides", "mechanism"), [
    ({"strategy": "dp-fedavg"}, "ddg"),
    ({"strategy": "dp-ftrl"}, "gaussian"),
    ({"strategy": "dp-fedavg", "adaptive-clip-quantile": 0.5}, "gaussian"),
    ({"strategy": "dp2-fedsam", "client-dp-adversary": "release"}, "gaussian"),
    ({"strategy": "fed-smp-randk", "accountant": "prv"}, "gaussian"),
])
def test_the_secure_sums_mechanism_follows_what_the_run_turns_on(overrides, mechanism):
    assert resolve_config(None, overrides).client_dp.secagg_mechanism == mechanism


def test_without_secure_aggregation_or_client_level_dp_the_mechanism_stays_unresolved():
    assert resolve_config(None, {"strategy": "dp-fedavg", "secure-aggregation": False}).client_dp.secagg_mechanism \
        == "auto"
    assert resolve_config(None, {"strategy": "robust-hdp"}).client_dp.secagg_mechanism == "auto"


@pytest.mark.parametrize(("overrides", "key"), [
    ({"strategy": "dp-ftrl", "secagg-mechanism": "ddg"}, "secagg-mechanism"),
    ({"strategy": "dp-fedavg", "adaptive-clip-quantile": 0.5, "secagg-mechanism": "ddg"}, "secagg-mechanism"),
    ({"strategy": "dp-fedavg", "client-dp-adversary": "release", "secagg-mechanism": "ddg"}, "client-dp-adversary"),
])
def test_a_conflicting_value_the_user_set_is_still_refused(overrides, key):
    with pytest.raises(ConfigError, match=key):
        resolve_config(None, overrides)


def test_adaptive_clippings_count_noise_default_works_at_any_cohort():
    """r/20 = 0.5 at 10 clients is below z/2 for the calibrated z: the default then takes σ_b = z; a value the user
    sets below z/2 is refused, naming the key."""
    cfg = resolve_config(None, {"strategy": "dp-fedavg", "adaptive-clip-quantile": 0.5})
    dp = client_level_mechanism(cfg.general, cfg.training, cfg.client_dp, 10)
    adaptive = adaptive_clip_config(cfg.client_dp, dp)
    assert adaptive is not None and 10 / 20 <= dp.noise_multiplier / 2
    assert adaptive.count_noise_std == dp.noise_multiplier
    large = client_level_mechanism(cfg.general, cfg.training, cfg.client_dp, 400)
    assert adaptive_clip_config(cfg.client_dp, large).count_noise_std == 400 / 20  # the paper's r/20 where it fits
    low = resolve_config(None, {"strategy": "dp-fedavg", "adaptive-clip-quantile": 0.5,
                                "adaptive-clip-count-noise": 0.1})
    with pytest.raises(ConfigError, match="'adaptive-clip-count-noise' = 0.1 must exceed"):
        adaptive_clip_config(low.client_dp, client_level_mechanism(low.general, low.training, low.client_dp, 10))
