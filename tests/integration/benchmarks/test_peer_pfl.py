"""benchmarks/peer_pfl.py pairs pfl's cohorts with ours: the sizes it exports are the ones our server samples."""

from __future__ import annotations

from conftest import read_rounds, run_small_simulation

from benchmarks.peer_pfl import our_cohort_sizes
from fedapp.config import resolve_config


def test_the_exported_cohort_sizes_are_the_ones_our_server_samples(tmp_path):
    """A real simulation of ``dp-fedavg`` with sampling from the run seed samples, round by round, exactly the
    cohort sizes the benchmark hands pfl's ``paired`` side (Poisson at q = r/n: sizes vary between rounds)."""
    overrides = {"strategy": "dp-fedavg", "num-server-rounds": 4, "clients-per-round": 3, "num-clients": 6,
                 "min-available-clients": 6, "seeded-noise": True, "seed": 11, "max-samples": 300,
                 "output-dir": str(tmp_path / "out"), "fraction-evaluate": 0.0, "local-test-fraction": 0.0}
    planned = our_cohort_sizes(resolve_config(None, overrides), n=6)
    sampled = [r["metrics"]["clients_sampled"] for r in read_rounds(run_small_simulation(overrides, num_supernodes=6))]
    assert sampled == planned and len(set(planned)) > 1, (sampled, planned)
