"""The shared start-up cache (fedapp.state.cache): decoded datasets and noise calibrations across processes."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from fedapp.data.datasets import _mnist_family_arrays, _mnist_family_files, _read_idx, load_dataset
from fedapp.state import cache
from strategies.privacy.accountants import epsilon_of
from strategies.privacy.calibration import calibrate_noise_multiplier


@pytest.fixture
def cache_root(tmp_path, monkeypatch):
    monkeypatch.setenv("DPFL_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_arrays_are_built_once_then_memory_mapped_copy_on_write(cache_root):
    calls = []

    def build():
        calls.append(1)
        return {"x": np.arange(12, dtype=np.float32).reshape(3, 4), "y": np.array([1, 2, 3])}

    first = cache.cached_arrays("demo", build)
    again = cache.cached_arrays("demo", build)
    assert len(calls) == 1 and isinstance(again["x"], np.memmap)
    np.testing.assert_array_equal(first["x"], again["x"])
    again["x"][0, 0] = 99.0  # writable, but the cached file is untouched (copy-on-write)
    assert cache.cached_arrays("demo", build)["x"][0, 0] == 0.0
    assert not list((cache_root / "datasets" / "demo").glob("*.tmp"))  # nothing half-written left behind


def test_incomplete_entries_are_rebuilt_and_off_disables_the_cache(cache_root, monkeypatch):
    (cache_root / "datasets" / "demo").mkdir(parents=True)
    (cache_root / "datasets" / "demo" / "x.npy").write_bytes(b"truncated")  # no complete.json: a crashed writer
    out = cache.cached_arrays("demo", lambda: {"x": np.ones(3)})
    np.testing.assert_array_equal(out["x"], np.ones(3))
    monkeypatch.setenv("DPFL_CACHE_DIR", "off")
    assert cache.cache_dir() is None
    assert cache.cached_arrays("other", lambda: {"x": np.zeros(2)})["x"].sum() == 0


def test_fingerprint_changes_with_the_source_files(tmp_path):
    f = tmp_path / "a"
    f.write_bytes(b"one")
    before = cache.fingerprint([f], 1)
    f.write_bytes(b"three")
    assert cache.fingerprint([f], 1) != before and cache.fingerprint([f], 2) != cache.fingerprint([f], 1)


def test_idx_reader_rejects_what_is_not_idx(tmp_path):
    bad = tmp_path / "x-idx1-ubyte"
    bad.write_bytes(b"\x00\x00\x0d\x01" + (3).to_bytes(4, "big") + b"abc")  # type 0x0d = float, not bytes
    with pytest.raises(ValueError, match="not an IDX file of unsigned bytes"):
        _read_idx(bad)
    short = tmp_path / "y-idx1-ubyte"
    short.write_bytes(b"\x00\x00\x08\x01" + (5).to_bytes(4, "big") + b"abc")
    with pytest.raises(ValueError, match="header says"):
        _read_idx(short)


def test_mnist_read_directly_equals_the_cached_copy(shared_data, cache_root):
    direct = _mnist_family_arrays("mnist", str(shared_data))
    raw = _read_idx(_mnist_family_files("mnist", str(shared_data))[0])
    assert raw.shape == (60000, 28, 28) and int(raw[0].sum()) == 27525 and raw[0, 14, 14] == 240  # the first "5"
    assert direct["train_y"][:10].tolist() == [5, 0, 4, 1, 9, 2, 1, 3, 1, 4]
    assert float(direct["train_x"][0, 0, 14, 14]) == pytest.approx((240 / 255 - 0.1307) / 0.3081, rel=1e-6)
    load_dataset.cache_clear()
    try:
        train, test = load_dataset("mnist", str(shared_data))  # builds the cache entry
        np.testing.assert_array_equal(train.x, direct["train_x"])
        assert (test.num_classes, len(train), len(test)) == (10, 60000, 10000)
    finally:
        load_dataset.cache_clear()
    # a second process maps the stored arrays instead of decoding (torchvision is not a dependency at all)
    code = ("import sys; from fedapp.data.datasets import load_dataset; tr, te = load_dataset('mnist', sys.argv[1]); "
            "import numpy as np; assert isinstance(tr.x, np.memmap); assert 'torchvision' not in sys.modules; "
            "print(float(tr.x[123].sum()))")
    out = subprocess.run([sys.executable, "-c", code, str(shared_data)], capture_output=True, text=True, check=True)
    assert float(out.stdout) == pytest.approx(float(direct["train_x"][123].sum()), rel=1e-6)


def test_a_cached_calibration_is_verified_never_trusted(cache_root):
    eps, delta, q, steps = 2.0, 1e-5, 0.05, 200
    z = cache.calibrated_noise_multiplier(eps, delta, q, steps, "rdp")
    assert z == pytest.approx(calibrate_noise_multiplier(eps, delta, q, steps), rel=1e-12)
    [entry] = list((cache_root / "calibrations").glob("*.json"))
    assert cache.calibrated_noise_multiplier(eps, delta, q, steps, "rdp") == z  # served from the cache
    tampered = json.loads(entry.read_text())
    tampered["value"] = z / 2  # half the noise: would spend far more than epsilon
    entry.write_text(json.dumps(tampered))
    again = cache.calibrated_noise_multiplier(eps, delta, q, steps, "rdp")
    assert epsilon_of([(again, q, steps)], delta, "rdp") <= eps * (1 + 1e-9) and again == pytest.approx(z)
    assert json.loads(entry.read_text())["value"] == pytest.approx(z)  # the bad entry was replaced


def test_partitions_are_computed_once_and_read_back_without_flwr_datasets(cache_root):
    from fedapp.config import resolve_config
    from fedapp.data.client_data import _partitions, client_partition_indices

    cfg = resolve_config({"partitioner": "dirichlet", "dirichlet-alpha": 0.5, "seed": 3})
    _partitions.cache_clear()
    first = client_partition_indices(cfg.data, cfg.general.seed, 6)
    assert sorted(np.concatenate(first).tolist()) == sorted(set(np.concatenate(first).tolist()))  # disjoint
    assert len(list((cache_root / "datasets").glob("partition-*"))) == 1
    code = ("import sys; from fedapp.data.client_data import client_partition_indices; from fedapp.config import "
            "resolve_config; cfg = resolve_config({'partitioner': 'dirichlet', 'dirichlet-alpha': 0.5, 'seed': 3}); "
            "parts = client_partition_indices(cfg.data, cfg.general.seed, 6); assert 'flwr_datasets' not in sys.modules; "
            "print(','.join(str(int(p.sum())) for p in parts))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ",".join(str(int(p.sum())) for p in first)
    _partitions.cache_clear()


def test_released_pool_pages_leave_the_process_and_the_values_stay(cache_root):
    """A read-only memory-mapped pool drops the pages this process read (PSS falls by their size) and reads
    back the same values from the page cache; writable arrays are never released (a written copy-on-write
    page would be lost)."""
    psutil = pytest.importorskip("psutil")
    n = 16 * 2**20 // 4  # 16 MB of float32
    x = cache.cached_arrays("pages", lambda: {"x": np.arange(n, dtype=np.float32)})["x"]
    proc = psutil.Process()
    total = float(x.sum(dtype=np.float64))  # touches every page
    touched = proc.memory_full_info().pss
    cache.release_mapped_pages(x)  # writable: left alone
    assert proc.memory_full_info().pss > touched - 4 * 2**20
    x.flags.writeable = False
    cache.release_mapped_pages(x, np.ones(3))  # a plain array is ignored
    assert proc.memory_full_info().pss < touched - 12 * 2**20
    assert float(x.sum(dtype=np.float64)) == total


def test_client_data_is_a_writable_copy_of_a_read_only_pool(cache_root):
    from fedapp.config import resolve_config
    from fedapp.data.client_data import load_client_data

    cfg = resolve_config({"dataset": "digits", "num-clients": 4})
    train, _ = load_dataset("digits")
    assert not train.x.flags.writeable and not train.y.flags.writeable
    local_train, _, _ = load_client_data(cfg.data, cfg.general.seed, 1, 4)
    assert local_train.x.flags.writeable and len(local_train) > 0  # the client's own copy


def test_cache_keys_change_with_the_libraries_that_produce_the_arrays(monkeypatch) -> None:
    """A partition cached under one flwr-datasets/numpy is not reused under another."""
    from fedapp.data import client_data
    from fedapp.state import cache

    assert cache.library_versions("numpy", "no-such-package-x").startswith("numpy=")
    assert cache.library_versions("no-such-package-x") == "no-such-package-x=-"
    names: list[str] = []

    def record(name, build):
        names.append(name)
        return build()

    monkeypatch.setattr(client_data, "cached_arrays", record)
    for versions in ("flwr-datasets=0.6.0,numpy=2.0", "flwr-datasets=0.7.0,numpy=2.0"):
        monkeypatch.setattr(client_data, "library_versions", lambda *names, v=versions: v)
        client_data._partitions.cache_clear()
        client_data._partitions("digits", "", 0, "iid", 4, 0, 8, 2, 0.5)
    assert len(names) == 2 and names[0] != names[1]
    client_data._partitions.cache_clear()


def test_a_cached_soteriafl_sigma_is_verified_never_trusted(cache_root):
    from strategies.privacy.accountants import epsilon_of
    from strategies.soteriafl import calibrate_sigma, noise_history

    args = ("svrg", 2.0, 1e-3, 0.5, 20, 200, 6, "rdp")  # estimator, ε, δ, clip, b, m, rounds, accountant
    sigma, split = cache.calibrated_soteriafl_sigma(*args)
    assert (sigma, split) == calibrate_sigma(*args)
    [entry] = list((cache_root / "soteriafl-sigma").glob("*.json"))
    calibrate_sigma.cache_clear()
    assert cache.calibrated_soteriafl_sigma(*args) == (sigma, split)  # served from the cache ...
    assert calibrate_sigma.cache_info().misses == 0  # ... without calibrating again
    tampered = json.loads(entry.read_text())
    tampered["value"] = [sigma / 2, split]  # half the noise: would spend far more than ε
    entry.write_text(json.dumps(tampered))
    again, again_split = cache.calibrated_soteriafl_sigma(*args)
    spent = epsilon_of(noise_history("svrg", again, 0.5, 20, 200, 6, again_split), 1e-3, "rdp")
    assert spent <= 2.0 * (1 + 1e-9) and again == pytest.approx(sigma)
    assert json.loads(entry.read_text())["value"][0] == pytest.approx(sigma)  # the bad entry was replaced
