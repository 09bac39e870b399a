"""SecAgg+'s Shamir work per round: Flower's functions (pycryptodome's arithmetic) against fedapp.privacy.shamir.

    .venv/bin/python -m benchmarks.shamir [--clients 10 50 100] [--repeats 3]

For r clients a round, every client a neighbour of every other (``secagg-num-shares = 1``, the default) and the
default threshold (half the shares): each client shares its two 32-byte secrets r ways (``create_shares``), and
the server's unmask stage reconstructs one secret per client from the r shares it collects (``combine_shares``).
Both implementations run on the same secrets in one process, alternating; the table gives the median over
``--repeats`` of each stage's time per round and the ratio Flower ÷ ours. Every reconstruction is checked.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable

from flwr.common.secure_aggregation.crypto import shamir as flower

from fedapp.privacy import shamir as ours

SECRET_BYTES = 32


def one_round(create: Callable[[bytes, int, int], list[bytes]], combine: Callable[[list[bytes]], bytes],
              r: int, threshold: int) -> tuple[float, float]:
    """Seconds of (all r clients' share creation, the server's r reconstructions) for one round."""
    secrets = [(os.urandom(SECRET_BYTES), os.urandom(SECRET_BYTES)) for _ in range(r)]
    t0 = time.perf_counter()
    shares = [create(seed, threshold, r) for seed, _ in secrets]
    for _, key in secrets:
        create(key, threshold, r)
    t1 = time.perf_counter()
    for (seed, _), owned in zip(secrets, shares, strict=True):
        if combine(owned) != seed:
            raise AssertionError("a reconstruction did not give the secret back")
    t2 = time.perf_counter()
    return t1 - t0, t2 - t1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, nargs="+", default=[10, 50, 100])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    print(f"# benchmarks.shamir {' '.join(sys.argv[1:])}  (load average {os.getloadavg()[0]:.1f})\n")
    print("| clients a round | threshold | share creation, all clients: Flower / ours | ÷ | "
          "reconstruction, server: Flower / ours | ÷ |")
    print("|---|---|---|---|---|---|")
    for r in args.clients:
        threshold = max(2, round(0.5 * r))  # Flower's: round(reconstruction_threshold × num_shares), at least 2
        times: dict[str, list[tuple[float, float]]] = {"flower": [], "ours": []}
        for k in range(args.repeats):
            for name in (("flower", "ours") if k % 2 == 0 else ("ours", "flower")):
                ours.lagrange_at_zero.cache_clear()  # every round pays for its coefficients
                impl = flower if name == "flower" else ours
                times[name].append(one_round(impl.create_shares, impl.combine_shares, r, threshold))
        med = {name: (statistics.median(t[0] for t in v), statistics.median(t[1] for t in v))
               for name, v in times.items()}
        print(f"| {r} | {threshold} | {med['flower'][0]:.3f} / {med['ours'][0]:.3f} s | "
              f"{med['flower'][0] / med['ours'][0]:.1f}× | {med['flower'][1]:.3f} / {med['ours'][1]:.3f} s | "
              f"{med['flower'][1] / med['ours'][1]:.1f}× |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
