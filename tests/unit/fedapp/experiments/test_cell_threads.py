"""A sweep cell's spawned process keeps to its share of the cores in torch and in numpy's BLAS."""

from __future__ import annotations


def _pools() -> tuple[int, list[int]]:
    import torch
    from threadpoolctl import threadpool_info

    return torch.get_num_threads(), [p["num_threads"] for p in threadpool_info() if p["user_api"] == "blas"]


def test_a_cell_process_limits_its_blas_pools_as_its_torch_threads(monkeypatch):
    """Asked for 4 OpenBLAS threads (it takes as many as there are cores), the cell process runs 1 in each pool."""
    from fedapp.experiments.sweep import _child

    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "4")  # the spawned child inherits it
    with _child(1) as child:
        torch_threads, blas = child.submit(_pools).result()
    assert torch_threads == 1
    assert blas and set(blas) == {1}
