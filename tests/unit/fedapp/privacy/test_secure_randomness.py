"""secure-randomness: every noise draw and sampling coin a client-level or SoteriaFL guarantee rests on comes from a
CSPRNG (ChaCha20), a SuperNode can force it, and the discrete Gaussian's shares keep Theorem 1's s >= 1/2."""

from __future__ import annotations

import json

import numpy as np
import pytest
from flwr.common import Context, RecordDict

from fedapp.clients.client_dp import FTRLClient, _array_from_json, _array_to_json
from fedapp.clients.common import csprng, noise_rng, setup_client
from fedapp.config import ConfigError, resolve_config
from strategies.privacy.discrete_gaussian import DistributedDiscreteGaussian
from strategies.server.sampling import ClientSampler


def bit_generator(rng: np.random.Generator) -> str:
    return type(rng.bit_generator).__name__


def test_the_run_config_or_the_node_config_turns_the_csprng_on():
    plain = resolve_config(None, {"strategy": "dp-fedavg"}).general
    secure = resolve_config(None, {"strategy": "dp-fedavg", "secure-randomness": True}).general
    assert bit_generator(noise_rng(plain, 0, 1)) == "PCG64"
    assert bit_generator(noise_rng(secure, 0, 1)) == "ChaCha"
    assert bit_generator(noise_rng(plain, 0, 1, {"secure-randomness": True})) == "ChaCha"  # the node's own choice
    a, b = noise_rng(secure, 0, 1), noise_rng(secure, 0, 1)
    assert not np.array_equal(a.standard_normal(8), b.standard_normal(8))  # a fresh 256-bit key each time
    draws = csprng().standard_normal(200_000)
    assert abs(draws.mean()) < 0.01 and abs(draws.std() - 1) < 0.01


@pytest.mark.parametrize(("overrides", "match"), [
    ({"strategy": "dpsgd-fedavg"}, "torchcsprng"),
    ({"strategy": "robust-hdp"}, "torchcsprng"),
    ({"strategy": "fedavg"}, "no effect"),
    ({"strategy": "dp-fedavg", "seeded-noise": True}, "seeded-noise"),
])
def test_settings_it_cannot_honour_are_refused_naming_the_key(overrides, match):
    with pytest.raises(ConfigError, match=f"secure-randomness.*{match}|{match}.*secure-randomness"):
        resolve_config(None, {**overrides, "secure-randomness": True})
    for ok in ("dp-fedavg", "soteriafl-sgd", "dp2-fedsam", "dp-ftrl"):
        resolve_config(None, {"strategy": ok, "secure-randomness": True, "secagg-mechanism": "gaussian"})


def test_a_dp_ftrl_stream_drawn_from_the_csprng_survives_its_context():
    """The stream's ChaCha state goes through Context.state as JSON and continues where it stopped."""
    ov = {"strategy": "dp-ftrl", "secagg-mechanism": "gaussian", "num-server-rounds": 4, "noise-multiplier": 2.0,
          "privacy-dist": "fixed", "batch-size": 8, "secure-randomness": True}
    ctx = Context(run_id=0, node_id=0, node_config={"partition-id": 0, "num-partitions": 3}, state=RecordDict(),
                  run_config={})
    client = FTRLClient(setup_client(ctx, ov), resolve_config(None, ov).client_dp, ctx)
    dp = client.mechanism()
    stream = client._load_stream(dp, 16, 1)
    assert bit_generator(stream.rng) == "ChaCha"
    stream.next()
    client._save_stream(stream)
    expected = [stream.next() for _ in range(2)]
    restored = FTRLClient(client.s, client.client_dp, ctx)._load_stream(dp, 16, 2)
    np.testing.assert_array_equal(np.stack([restored.next() for _ in range(2)]), np.stack(expected))
    state = csprng().bit_generator.state
    back = json.loads(json.dumps(state, default=_array_to_json), object_hook=_array_from_json)
    assert all(np.array_equal(back["state"][k], v) for k, v in state["state"].items())


def test_the_servers_client_sampling_draws_from_the_csprng_and_never_checkpoints_its_key():
    sampler = ClientSampler(5, "poisson", None, csprng())
    sampler.fix_rate(0.25)
    chosen = [len(sampler.sample(t, list(range(20)))) for t in range(1, 400)]
    assert 4.5 < np.mean(chosen) < 5.5 and sampler.state() == {}
    sampler.load({"rng": {"bit_generator": "PCG64"}})  # an old checkpoint's PCG64 state is not forced onto it
    assert bit_generator(sampler.rng) == "ChaCha"


def test_discrete_gaussian_shares_below_half_an_integer_std_are_refused():
    """8 bits for 200 clients: γ is so coarse that each share's std is 0.25 < 1/2, outside Theorem 1's hypothesis."""
    with pytest.raises(ValueError, match="s = 0.245.*below 0.5"):
        DistributedDiscreteGaussian(clip=1.0, noise_multiplier=1.0, max_cohort=200, dim=1000, bits=8)
    ok = DistributedDiscreteGaussian(clip=1.0, noise_multiplier=1.0, max_cohort=100, dim=1000, bits=8)
    assert ok.scaled_std(100) >= 0.5
    # calibration raises σ past the σ whose shares would fall below 1/2 (there the bound is not claimed)
    calibrated = DistributedDiscreteGaussian.calibrated(1.0, clip=1.0, max_cohort=200, dim=1000, bits=8)
    assert calibrated.scaled_std(200) >= 0.5 and calibrated.gaussian_equivalent(200, 200) >= 1.0
