"""A sweep's figures as the Markdown table bench/RESULTS.md records: per set, the source run's export and prompt
lookup, then each variant with what it changed, its training cost, its curve and its margin over the source at
the headline k with the interval over the set's prompts (bench/bench_train_sweep.py writes them).

    python bench/sweep_table.py sweep-all.json [more.json ...] --k 3
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

NOT_TRAINING = {"measure"}  # variant keys that say how it was measured, not what it changed


def margin_cell(margin: dict[str, Any] | None) -> str:
    if not margin:
        return ""
    if margin["low"] is None:
        return f"{margin['difference']:+.2f} (no interval: {margin['prompts']} prompts)"
    return f"{margin['difference']:+.2f} ({margin['low']:+.2f} to {margin['high']:+.2f})"


def curve_cells(curve: dict[str, float], ks: list[str]) -> list[str]:
    return [f"{curve[k]:.2f}" if k in curve else "" for k in ks]


def changed(fields: dict[str, Any]) -> str:
    return ", ".join(f"{key} {value}" for key, value in fields.items() if key not in NOT_TRAINING)


def table(sweeps: list[dict[str, Any]], k: str) -> list[str]:
    """Markdown lines: one block of rows per set, the source and lookup first, then every variant of every sweep."""
    source = sweeps[0].get("one_pass", {}).get("source", {})
    sets = list(source) or list(dict.fromkeys(name for sweep in sweeps for v in sweep["variants"].values()
                                              for name in v["sets"]))
    ks = sorted({key for one in source.values() for key in one["curve"]}
                | {key for sweep in sweeps for v in sweep["variants"].values() for s in v["sets"].values()
                   for key in s["curve"]}, key=int)
    lines = [f"| set | drafter | changed | files | steps | training | {' | '.join(f'k = {key}' for key in ks)} | "
             f"over the source at k = {k} (95%) |",
             "| " + " | ".join(["---"] * (7 + len(ks))) + " |"]
    for name in sets:
        mine = source.get(name)
        if mine:
            lines.append(f"| {name} | the run's export | | | | | {' | '.join(curve_cells(mine['curve'], ks))} | "
                         f"over lookup {margin_cell(mine.get('over_lookup', {}).get(k))} |")
            if "lookup_curve" in mine:
                lines.append(f"| {name} | prompt lookup | | | | | {' | '.join(curve_cells(mine['lookup_curve'], ks))} | |")
        for sweep in sweeps:
            for variant, figures in sweep["variants"].items():
                one = figures["sets"].get(name)
                if one is None:
                    continue
                lines.append(f"| {name} | {variant} | {changed(figures['fields'])} | {figures['files']:,} | "
                             f"{figures['steps']:,} | {figures['train_s'] / 60:.1f} min | "
                             f"{' | '.join(curve_cells(one['curve'], ks))} | "
                             f"{margin_cell(one.get('over_source', {}).get(k))} |")
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("sweeps", type=Path, nargs="+", help="bench_train_sweep.py JSON files of one source run")
    parser.add_argument("--k", default="3", help="the k whose margins the last column shows")
    args = parser.parse_args(argv)
    sweeps = [json.loads(path.read_text()) for path in args.sweeps]
    runs = {sweep["source_run"] for sweep in sweeps}
    if len(runs) > 1:
        parser.error(f"sweeps of different source runs {sorted(runs)}: their margins are over different exports")
    sys.stdout.write("\n".join(table(sweeps, args.k)) + "\n")


if __name__ == "__main__":
    main()
