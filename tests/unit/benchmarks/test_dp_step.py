"""``benchmarks.foundation step`` on the smallest catalog model: every mode's zero-noise check and the noise floors."""

from __future__ import annotations

import re

from benchmarks.dp_step import bench_model


def test_step_table_checks_every_mode_and_states_the_noise_floor() -> None:
    rows = bench_model("logreg", rounds=1, steps=1, batch=8)
    by_label = {row.split(" | ")[1]: row for row in rows}
    for mode in ("hooks", "ew", "functorch", "ghost", "bk"):
        assert "same as `hooks`" in by_label[f"DP-SGD `{mode}`"], by_label[f"DP-SGD `{mode}`"]
    for label in ("Opacus' noise alone (not a step)", "`bk`'s noise added to the sums (not a step)"):
        floor = re.search(r"floor: .* = ([0-9.]+)×", by_label[label])
        assert floor is not None and float(floor.group(1)) >= 1.0, by_label[label]  # 2 decimals: 1.00 under load
