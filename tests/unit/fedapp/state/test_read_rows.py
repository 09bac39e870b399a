"""fedapp.state.cache.read_rows: a mapped pool's rows, read from its file without mapping the pool."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from fedapp.state import cache
from fedapp.state.cache import read_rows, release_mapped_pages


@pytest.fixture(params=["span", "runs"])
def reads(request, monkeypatch):
    """Both ways read_rows reads a file: the whole span of the rows in one call (small pools, labels), or one call
    per run of consecutive rows (forced here by a span threshold of 0)."""
    if request.param == "runs":
        monkeypatch.setattr(cache, "SPAN_READ_FACTOR", 0)
        monkeypatch.setattr(cache, "SPAN_READ_BYTES", 0)
    return request.param


def _pool(tmp_path: Path, shape: tuple[int, ...], dtype: str = "float32", name: str = "pool") -> np.ndarray:
    data = np.arange(int(np.prod(shape)), dtype=dtype).reshape(shape)
    np.save(tmp_path / f"{name}.npy", data)
    arr = np.load(tmp_path / f"{name}.npy", mmap_mode="c")
    arr.flags.writeable = False  # what fedapp.data.datasets.load_dataset hands out
    return arr


@pytest.mark.parametrize("idx", [[0], [3, 4, 5, 9, 1, 2], [-1, 0, -7], list(range(40)), [7, 7, 7]],
                         ids=["one", "runs", "negative", "all", "repeated"])
def test_rows_are_what_indexing_gives(tmp_path, idx, reads):
    arr = _pool(tmp_path, (40, 1, 3, 5))
    got = read_rows(arr, np.asarray(idx))
    assert not isinstance(got, np.memmap) and got.flags.writeable
    np.testing.assert_array_equal(got, np.asarray(arr)[idx])


def test_views_labels_and_what_it_leaves_to_numpy(tmp_path, reads):
    arr = _pool(tmp_path, (40, 6))
    np.testing.assert_array_equal(read_rows(arr[5:], np.array([0, 3, 34])), np.asarray(arr)[[5, 8, 39]])
    labels = _pool(tmp_path, (50,), "int64", name="labels")
    np.testing.assert_array_equal(read_rows(labels, np.array([49, 0, 1])), np.array([49, 0, 1]))
    with pytest.raises(IndexError):
        read_rows(arr, np.array([40]))
    mask = np.zeros(40, dtype=bool)
    mask[[2, 9]] = True
    np.testing.assert_array_equal(read_rows(arr, mask), np.asarray(arr)[mask])
    assert read_rows(arr, np.array([], dtype=np.int64)).shape == (0, 6)
    writable = np.load(tmp_path / "pool.npy", mmap_mode="c")
    writable[0] = -1  # a copy-on-write change the file does not have: indexed through the mapping
    assert read_rows(writable, np.array([0]))[0, 0] == -1


def test_labels_are_read_in_one_call_and_spread_out_rows_one_call_per_run(tmp_path, monkeypatch):
    """A pool's labels span little of the file: one read. Rows spread over a large pool: one read per run of
    consecutive indices, never the span between them."""
    import os

    calls: list[int] = []
    real = os.preadv

    def counted(fd, buffers, offset):
        calls.append(sum(memoryview(b).nbytes for b in buffers))
        return real(fd, buffers, offset)

    monkeypatch.setattr(os, "preadv", counted)
    labels = _pool(tmp_path, (60_000,), "int64", name="labels")  # 480 kB
    idx = np.random.default_rng(0).choice(len(labels), 3_000, replace=False)
    np.testing.assert_array_equal(read_rows(labels, idx), np.asarray(labels)[idx])
    assert len(calls) == 1
    calls.clear()
    rows = _pool(tmp_path, (4_096, 1_024))  # 16 MB of 4 kB rows
    idx = np.r_[np.arange(10, 14), [4_000, 7], np.arange(2_000, 2_003)]  # three runs and two single rows
    np.testing.assert_array_equal(read_rows(rows, idx), np.asarray(rows)[idx])
    assert calls == [4 * 4096, 4096, 4096, 3 * 4096]


def _pss_kb() -> int:
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
        if line.startswith("Pss:"):
            return int(line.split()[1])
    raise AssertionError("no Pss line")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/smaps_rollup is Linux's")
def test_a_client_gather_maps_nothing_of_the_pool(tmp_path):
    """A spread-out 1/16 of a 64 MB pool: indexing the mapping pulls most of the pool into this process's PSS
    (each fault also maps the cached pages around it); read_rows adds only the rows it copies."""
    arr = _pool(tmp_path, (16_384, 1024))  # 4 KB rows, 64 MB
    (tmp_path / "pool.npy").read_bytes()  # in the page cache, as a pool every actor shares
    idx = np.random.default_rng(0).choice(len(arr), 1024, replace=False)
    before = _pss_kb()
    rows = read_rows(arr, idx)
    read_growth = _pss_kb() - before
    del rows
    before = _pss_kb()
    indexed = np.asarray(arr)[idx]
    indexed_growth = _pss_kb() - before
    assert indexed.shape == (1024, 1024)
    release_mapped_pages(arr)
    print(f"PSS growth: read_rows {read_growth} kB, indexing {indexed_growth} kB")
    assert read_growth < 8 * 1024, read_growth  # ~4 MB of rows
    assert indexed_growth > 24 * 1024, indexed_growth  # the mapping brought much of the 64 MB along
