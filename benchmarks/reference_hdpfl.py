"""Robust-HDP: this project's aggregation weights against the authors' reference code on the same updates.

Reference: github.com/Saber-mm/HDPFL. Its ``utils/aggregate.py`` class ``R_pca`` (Principal Component Pursuit by
ADMM with a fixed μ = pn / (4‖M‖₁), ``np.linalg.norm(M, ord=1)`` = the largest column ℓ1 norm, λ = 1/√max(p, n))
is loaded from ``--ref-path`` (default ``/tmp/ref/hdpfl``; the script exits with a message when it is absent) and
called exactly as ``algs/HDPFL.py`` (lines 269-283) calls it::

    L, S = R_pca(M).fit(tol=5e-8)                      # absolute tolerance on ‖M − L − S‖_F, ≤ 10,000 iterations
    w_i ∝ 1 / ‖S[:, i]‖²                               # Robust-HDP Eq. 8 with σ̂_i² = ‖S[:, i]‖² (Alg. 1)

(numpy ≥ 2 removed ``np.Inf``, which ``fit`` reads once; it is restored as an alias of ``np.inf`` while it runs.)
This project's weights come from ``RobustHDP.raw_weights`` (``strategies/robust_hdp.py``) with the run-config
defaults (``fedapp.apps.factories.rpca_options``: inexact ALM, float32, relative tol 1e-4, ρ = 1.5) and, as
diagnostics, ``strategies.rpca.rpca`` in float64 at tol 1e-7 and at a slow μ growth (ρ = 1.05, tol 1e-9).

Updates follow the model the paper assumes (Sec. 3, Eq. 7): column i = shared signal + client scale · signal
+ N(0, σ_i²/p · I_p), σ_i² known. Two families of σ_i²:

* ``dist*``: Eq.-7 noise of the paper's MNIST setting (20 clients, N_i = 2400, b_i ∈ {16, 32, 64, 128}, c = 3,
  δ = 1e-4, E = 200, ε_i from Table 7 — ``benchmarks/robust_hdp.py``'s Table-3 inputs) times lr² with the
  Table-8 Robust-HDP learning rate, so the matrix has the absolute scale of a real round-1 update matrix (the
  reference's tolerance is absolute); the first p rows (Sec. 3.6 blocks keep the per-coordinate variance);
* ``spread R``: σ_i² log-uniform on [1, R] × 1e-4 (R = 1: homogeneous).

Reported per matrix: weights side by side, max |w − w_ref|, max |w/w_ref − 1|, Spearman rank correlation, each
against the ideal w*_i ∝ 1/σ_i² (max |w/w* − 1|, Spearman, aggregate noise variance Σ w_i² σ_i² / Σ w*_i² σ_i²),
and the PCP objective ‖L‖_* + λ‖S‖₁ of each decomposition (lower = closer to the PCP optimum).

    .venv/bin/python benchmarks/reference_hdpfl.py                    # ~16 min on 2 shared cores
    .venv/bin/python benchmarks/reference_hdpfl.py --quick            # p ≤ 1,000 only, a few minutes
    .venv/bin/python benchmarks/reference_hdpfl.py --full-size        # + p = 28,938 (the reference: ~25 min)
    .venv/bin/python benchmarks/reference_hdpfl.py --only-real --real dist4   # real DP-SGD round-1 updates
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import json
import re
import sys
import time
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.robust_hdp import P_MNIST, TABLE8, as_client_updates, eq7_sigma2  # noqa: E402
from fedapp.apps.factories import rpca_options  # noqa: E402
from fedapp.config import resolve_config  # noqa: E402
from fedapp.privacy.profiles import federation_profiles  # noqa: E402
from strategies.robust_hdp import RobustHDP  # noqa: E402
from strategies.rpca import inverse_variance_weights, rpca  # noqa: E402

REF_TOL = 5e-8  # algs/HDPFL.py: RPCA.fit(tol=5e-8)


# ----------------------------------------------------------------------------- reference
def load_reference(path: Path) -> types.ModuleType:
    """Import ``utils/aggregate.py`` of the HDPFL checkout at ``path`` (it needs torch, numpy, scikit-learn)."""
    file = path / "utils" / "aggregate.py"
    if not file.is_file():
        raise FileNotFoundError(str(file))
    spec = importlib.util.spec_from_file_location("hdpfl_reference_aggregate", file)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {file}")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@contextlib.contextmanager
def numpy_inf_alias() -> Iterator[None]:
    """``np.Inf`` (removed in numpy 2.0) for the duration of the reference's ``fit``."""
    had = "Inf" in np.__dict__
    if not had:
        np.Inf = np.inf  # type: ignore[attr-defined]
    try:
        yield
    finally:
        if not had:
            del np.Inf  # type: ignore[attr-defined]


def reference_weights(ref: types.ModuleType, m: np.ndarray) -> dict[str, Any]:
    """``algs/HDPFL.py`` lines 269-283: R_pca(M).fit(tol=5e-8), w_i ∝ 1/‖S[:, i]‖²."""
    t0 = time.perf_counter()
    solver = ref.R_pca(m)
    log = io.StringIO()
    with numpy_inf_alias(), contextlib.redirect_stdout(log):
        low, sparse = solver.fit(tol=REF_TOL)
    last = re.findall(r"iteration: (\d+), error: ([0-9.eE+-]+)", log.getvalue())[-1]
    s2 = np.array([np.linalg.norm(sparse[:, i]) ** 2 for i in range(sparse.shape[1])])
    inv = 1 / s2
    return {"weights": inv / inv.sum(), "sigma2_hat": s2, "iterations": int(last[0]), "residual": float(last[1]),
            "converged": float(last[1]) <= REF_TOL, "mu": float(solver.mu), "seconds": time.perf_counter() - t0,
            "objective": pcp_objective(low, sparse)}


# ----------------------------------------------------------------------------- this project
def project_weights(m: np.ndarray) -> dict[str, Any]:
    """``RobustHDP.raw_weights`` with the run-config defaults, on the columns of ``m`` as float32 updates."""
    cfg = resolve_config(overrides={"strategy": "robust-hdp"})
    strat = RobustHDP(initial_weights=[np.zeros(1, np.float32)], num_rounds=1, rpca_options=rpca_options(cfg.robust_hdp))
    ups = as_client_updates([np.ascontiguousarray(m[:, i], dtype=np.float32) for i in range(m.shape[1])])
    t0 = time.perf_counter()
    raw, extra = strat.raw_weights(1, ups)
    seconds = time.perf_counter() - t0
    s2 = np.array([u.record["sigma2_estimated"] for u in ups])
    res = rpca(m.astype(np.float32), **rpca_options(cfg.robust_hdp))  # the same solve again, for its L, S and objective
    return {"weights": raw / raw.sum(), "sigma2_hat": s2, "iterations": int(extra["rpca_iterations"]),
            "converged": bool(extra["rpca_converged"]), "seconds": seconds,
            "objective": pcp_objective(res.low_rank, res.sparse), "options": {k: str(v) for k, v in rpca_options(cfg.robust_hdp).items()}}


def project_rpca(m: np.ndarray, **opts: Any) -> dict[str, Any]:
    """``strategies.rpca.rpca`` with explicit options, weights ∝ 1/‖S[:, i]‖² (diagnostics)."""
    t0 = time.perf_counter()
    res = rpca(m, max_iter=20_000, **opts)
    s2 = np.sum(res.sparse**2, axis=0)
    return {"weights": inverse_variance_weights(s2), "sigma2_hat": s2, "iterations": res.iterations,
            "converged": res.converged, "seconds": time.perf_counter() - t0,
            "objective": pcp_objective(res.low_rank, res.sparse)}


# ----------------------------------------------------------------------------- inputs and metrics
def pcp_objective(low: np.ndarray | None, sparse: np.ndarray) -> float:
    """‖L‖_* + λ‖S‖₁ with λ = 1/√max(p, n) (the PCP problem both codes solve)."""
    assert low is not None
    lam = 1 / np.sqrt(max(sparse.shape))
    return float(np.linalg.svd(np.asarray(low, np.float64), compute_uv=False).sum() + lam * np.abs(sparse).sum())


def updates(sigma2: np.ndarray, p: int, seed: int, snr: float = 1.0) -> np.ndarray:
    """p × n: column i = (1 + 0.1 z_i) g + N(0, σ_i²/p I), ‖g‖ = snr · min_i σ_i (as ``benchmarks/robust_hdp.py``)."""
    rng = np.random.default_rng(seed)
    g = rng.normal(size=p)
    g *= snr * np.sqrt(sigma2.min()) / np.linalg.norm(g)
    return np.stack([g * (1 + 0.1 * rng.normal()) + rng.normal(scale=np.sqrt(s / p), size=p) for s in sigma2], axis=1)


def dist_sigma2(dist: str, p: int, seed: int = 42) -> np.ndarray:
    """Eq.-7 σ_i² of ``dist`` (MNIST setting, E = 200) × lr², restricted to the first p of 28,938 coordinates."""
    cfg = resolve_config(overrides={"privacy-dist": dist, "batch-size-choices": "16,32,64,128", "seed": seed})
    prof = federation_profiles(cfg.general, cfg.training, cfg.data, 20)
    s2 = np.array([eq7_sigma2(q.epsilon, q.batch_size, 200) for q in prof])
    return s2 * TABLE8["robust-hdp"][dist] ** 2 * p / P_MNIST


def spearman(a: np.ndarray, b: np.ndarray) -> float:
    ra, rb = np.argsort(np.argsort(a)), np.argsort(np.argsort(b))
    return float(np.corrcoef(ra, rb)[0, 1]) if np.std(ra) > 0 and np.std(rb) > 0 else float("nan")


def compare(w: np.ndarray, w_ref: np.ndarray, w_star: np.ndarray, sigma2: np.ndarray) -> dict[str, float]:
    return {"max_abs_diff_vs_ref": float(np.abs(w - w_ref).max()),
            "max_rel_diff_vs_ref": float(np.abs(w / w_ref - 1).max()),
            "spearman_vs_ref": spearman(w, w_ref),
            "max_rel_diff_vs_ideal": float(np.abs(w / w_star - 1).max()),
            "spearman_vs_ideal": spearman(w, w_star),
            "noise_variance_vs_ideal": float(np.sum(w**2 * sigma2) / np.sum(w_star**2 * sigma2))}


def one_case(ref: types.ModuleType, name: str, sigma2: np.ndarray, p: int, seed: int, snr: float,
             diagnostics: bool) -> dict[str, Any]:
    m = updates(sigma2, p, seed, snr)
    w_star = inverse_variance_weights(sigma2)
    r = reference_weights(ref, m)
    rows: dict[str, Any] = {"reference": r, "ours (run-config default)": project_weights(m)}
    if diagnostics:
        rows["ours float64 tol 1e-7"] = project_rpca(m, tol=1e-7)
        rows["ours float64 rho 1.05 tol 1e-9"] = project_rpca(m, tol=1e-9, rho=1.05)
    out: dict[str, Any] = {"case": name, "p": p, "n": len(sigma2), "seed": seed, "snr": snr,
                           "sigma2": sigma2.tolist(), "ideal_weights": w_star.tolist(), "fro_norm": float(np.linalg.norm(m)),
                           "solvers": {}}
    for key, res in rows.items():
        cmp = compare(res["weights"], r["weights"], w_star, sigma2)
        ratio = res["sigma2_hat"] / sigma2
        order = np.argsort(sigma2)
        lo, hi = order[: max(1, len(sigma2) // 4)], order[-max(1, len(sigma2) // 4):]
        out["solvers"][key] = {**cmp, "iterations": res["iterations"], "converged": res["converged"],
                               "seconds": res["seconds"], "objective": res["objective"],
                               "objective_vs_ref": res["objective"] / r["objective"] - 1,
                               "sigma2_hat_over_sigma2_least_noisy_quarter": float(np.mean(ratio[lo])),
                               "sigma2_hat_over_sigma2_noisiest_quarter": float(np.mean(ratio[hi])),
                               "sigma2_hat_over_sigma2": ratio.tolist(),
                               "weights": res["weights"].tolist()}
    return out


def real_updates(dist: str, data_dir: str, max_samples: int, lr: float) -> tuple[np.ndarray, np.ndarray, dict[str, Any]]:
    """Round-1 updates of 20 of this project's DP-SGD clients (``DPSGDClient.fit``, Opacus) in the setting of the
    Table-12 analogue of ``docs/benchmarks/robust_hdp.md`` (MNIST shards, Table-5 CNN, c = 3, δ = 1e-4, K_i = 1,
    b_i ∈ {16, …, 128}, ε_i from ``dist`` planned for 40 rounds); σ_i² from Eq. 7 with each client's reported
    (z_i, q_i, steps_i, η) — ``oracle_sigma2``, checked against real Opacus updates to ±10 % in the tests."""
    from flwr.common import Context, RecordDict

    from fedapp.clients.common import setup_client
    from fedapp.clients.dpsgd import DPSGDClient
    from fedapp.clients.training import get_weights
    from strategies.robust_hdp import oracle_sigma2

    ov = {"strategy": "robust-hdp", "dataset": "mnist", "data-dir": data_dir, "num-server-rounds": 40,
          "partitioner": "shards", "shards-per-client": 8, "privacy-dist": dist, "batch-size-choices": "16,32,64,128",
          "clip-norm": 3.0, "delta": 1e-4, "local-epochs": 1, "lr": lr, "max-samples": max_samples,
          "local-test-fraction": 0.2}
    cols, s2, meta, params = [], [], [], None
    for cid in range(20):
        ctx = Context(run_id=1, node_id=cid + 100, node_config={"partition-id": cid, "num-partitions": 20},
                      state=RecordDict(), run_config={})
        client = DPSGDClient(setup_client(ctx, ov), ctx, private=True)
        if params is None:
            params = get_weights(client.s.new_model())
        update, _, met = client.fit(params, {"server-round": 1})
        vec = np.concatenate([np.asarray(u, dtype=np.float64).ravel() for u in update])
        cols.append(vec)
        s2.append(oracle_sigma2(noise_multiplier=met["noise_multiplier"], clip=3.0, num_train=met["num_train"],
                                sample_rate=met["sample_rate"], steps=met["steps_round"], lr=met["lr"],
                                num_params=vec.size))
        meta.append({k: met[k] for k in ("batch_size", "num_train", "noise_multiplier", "steps_round", "reported_epsilon")})
    return np.stack(cols, axis=1), np.asarray(s2), {"clients": meta, "overrides": ov}


def one_matrix(ref: types.ModuleType, name: str, m: np.ndarray, sigma2: np.ndarray) -> dict[str, Any]:
    """:func:`one_case` on a given matrix (real updates): reference, run-config default, ρ = 1.05 diagnostic."""
    w_star = inverse_variance_weights(sigma2)
    r = reference_weights(ref, m)
    rows = {"reference": r, "ours (run-config default)": project_weights(m),
            "ours float64 rho 1.05 tol 1e-9": project_rpca(m, tol=1e-9, rho=1.05)}
    out: dict[str, Any] = {"case": name, "p": m.shape[0], "n": m.shape[1], "seed": 0, "snr": float("nan"),
                           "sigma2": sigma2.tolist(), "ideal_weights": w_star.tolist(),
                           "fro_norm": float(np.linalg.norm(m)), "solvers": {}}
    for key, res in rows.items():
        ratio = res["sigma2_hat"] / sigma2
        order = np.argsort(sigma2)
        q = max(1, len(sigma2) // 4)
        out["solvers"][key] = {**compare(res["weights"], r["weights"], w_star, sigma2),
                               "iterations": res["iterations"], "converged": res["converged"],
                               "seconds": res["seconds"], "objective": res["objective"],
                               "objective_vs_ref": res["objective"] / r["objective"] - 1,
                               "sigma2_hat_over_sigma2_least_noisy_quarter": float(np.mean(ratio[order[:q]])),
                               "sigma2_hat_over_sigma2_noisiest_quarter": float(np.mean(ratio[order[-q:]])),
                               "sigma2_hat_over_sigma2": ratio.tolist(), "weights": res["weights"].tolist()}
    return out


def print_case(c: dict[str, Any]) -> None:
    print(f"{c['case']}: p = {c['p']:,} × n = {c['n']}, ‖M‖_F = {c['fro_norm']:.3g}, σ² spread "
          f"{max(c['sigma2']) / min(c['sigma2']):.3g}, SNR {c['snr']}", flush=True)
    for key, s in c["solvers"].items():
        print(f"  {key:31s} it {s['iterations']:>5} conv {str(s['converged']):5s} {s['seconds']:7.2f}s | "
              f"vs ref: max|Δw| {s['max_abs_diff_vs_ref']:.4f} max rel {s['max_rel_diff_vs_ref']:.3f} "
              f"ρ_s {s['spearman_vs_ref']:.3f} | vs ideal: max rel {s['max_rel_diff_vs_ideal']:.3f} "
              f"ρ_s {s['spearman_vs_ideal']:.3f} NV/NV* {s['noise_variance_vs_ideal']:.4f} | "
              f"obj {s['objective_vs_ref']:+.2e} | σ̂²/σ² least/most noisy quarter "
              f"{s['sigma2_hat_over_sigma2_least_noisy_quarter']:.3f}/{s['sigma2_hat_over_sigma2_noisiest_quarter']:.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ref-path", default="/tmp/ref/hdpfl", help="checkout of Saber-mm/HDPFL")
    ap.add_argument("--quick", action="store_true", help="p = 1,000 only")
    ap.add_argument("--full-size", action="store_true", help="also p = 28,938 (MNIST CNN) for dist2 (minutes)")
    ap.add_argument("--seeds", type=int, default=1, help="matrices per case (seeds 0..N-1)")
    ap.add_argument("--real", default="", help="also round-1 updates of real DP-SGD clients for these dists, "
                    "e.g. dist2,dist4 (MNIST from --data-dir; ~1 min of training per dist)")
    ap.add_argument("--only-real", action="store_true", help="skip the synthetic cases")
    ap.add_argument("--data-dir", default=str(ROOT.parent / "shared" / "data"))
    ap.add_argument("--max-samples", type=int, default=7500)
    ap.add_argument("--json", default="", help="write every number to this file")
    args = ap.parse_args()
    try:
        ref = load_reference(Path(args.ref_path))
    except (FileNotFoundError, ImportError) as exc:
        print(f"SKIP: reference code not found ({exc}). Extract github.com/Saber-mm/HDPFL to --ref-path.")
        return
    t0 = time.perf_counter()
    sizes = (1000,) if args.quick else (1000, 5000)
    cases: list[dict[str, Any]] = []
    for seed in range(0 if args.only_real else args.seeds):
        for p in sizes:
            for dist in ("dist2", "dist4", "dist6", "dist8"):
                cases.append(one_case(ref, f"{dist} (Eq. 7 × lr²)", dist_sigma2(dist, p), p, seed, 1.0, True))
                print_case(cases[-1])
        rng = np.random.default_rng(seed)
        for n in (10, 20):
            for spread in (1.0, 10.0, 100.0, 1000.0):
                s2 = 1e-4 * np.exp(rng.uniform(0, np.log(spread), n))
                cases.append(one_case(ref, f"spread {spread:g}", s2, 2000 if not args.quick else 1000, seed, 1.0, True))
                print_case(cases[-1])
        base = 1e-4 * np.exp(np.random.default_rng(seed).uniform(0, np.log(100.0), 20))
        for snr in (0.3, 3.0, 10.0):
            cases.append(one_case(ref, "spread 100, other SNR", base, 1000, seed, snr, True))
            print_case(cases[-1])
        for scale in (1e-2, 1e2):
            cases.append(one_case(ref, f"spread 100, updates × {scale:g}", base * scale**2, 1000, seed, 1.0, False))
            print_case(cases[-1])
    for dist in [d for d in args.real.split(",") if d]:
        lr = 10 * TABLE8["robust-hdp"][dist]  # the accuracy runs' --lr-scale 10
        t1 = time.perf_counter()
        m, s2, meta = real_updates(dist, args.data_dir, args.max_samples, lr)
        print(f"[{dist}] 20 DP-SGD clients trained in {time.perf_counter() - t1:.0f}s", flush=True)
        cases.append({**one_matrix(ref, f"{dist} real DP-SGD round-1 updates (lr {lr:g})", m, s2), **meta})
        print_case(cases[-1])
    if args.full_size:
        cases.append(one_case(ref, "dist2 (Eq. 7 × lr²)", dist_sigma2("dist2", P_MNIST), P_MNIST, 0, 1.0, False))
        print_case(cases[-1])
    if args.json:
        Path(args.json).write_text(json.dumps({"cases": cases, "seconds": time.perf_counter() - t0}, indent=1))
    print(f"done in {time.perf_counter() - t0:.0f}s")


if __name__ == "__main__":
    main()
