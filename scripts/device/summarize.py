"""Per-round times of the device check's cells (scripts/device/check.sh): a markdown table on stdout and the rounds
as JSON.

    python3 scripts/device/summarize.py CELLS_DIR OUT_JSON

CELLS_DIR holds one sweep folder per cell (``<cell>/cells/<id>/<run>/rounds.jsonl`` and ``config.json``), each stopped
after its first rounds. A cell's projected time is round 1 plus the median of the later rounds times the rounds left of
``num-server-rounds``.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path


def cell_rounds(folder: Path) -> list[dict]:
    """Every run of one sweep folder: its name, planned rounds, device and the wall seconds of each round."""
    runs = []
    for rounds_file in sorted(folder.glob("cells/*/*/rounds.jsonl")):
        config = json.loads((rounds_file.parent / "config.json").read_text()).get("config", {})
        lines = [json.loads(line) for line in rounds_file.read_text().splitlines() if line.strip()]
        runs.append({"cell": folder.name, "run": rounds_file.parent.name, "planned": int(config.get("num-server-rounds", 0)),
                     "device": config.get("device"), "seconds": [float(r["wall_seconds"]) for r in lines]})
    return runs


def row(run: dict) -> str:
    s = run["seconds"]
    if not s:
        return f"| {run['cell']} | 0 | – | – | {run['planned']} | – |"
    later = statistics.median(s[1:]) if len(s) > 1 else float("nan")
    projected = s[0] + later * (run["planned"] - 1) if len(s) > 1 else float("nan")
    return (f"| {run['cell']} | {len(s)} | {s[0]:.1f} s | {later:.2f} s | {run['planned']} | "
            f"{projected / 60:.1f} min |")


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    cells, out = Path(argv[0]), Path(argv[1])
    runs = [run for folder in sorted(p for p in cells.iterdir() if p.is_dir()) for run in cell_rounds(folder)]
    out.write_text(json.dumps(runs, indent=1))
    print("| cell | rounds run | round 1 | later rounds (median) | rounds planned | projected cell |")
    print("|---|---|---|---|---|---|")
    for run in runs:
        print(row(run))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
