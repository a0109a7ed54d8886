"""The acceptance curve of a pipeline benchmark as a PNG: one panel per evaluation set, acceptance length
against the chain length k for the drafter and prompt lookup, and the no-drafter line, all measured in the
same run on the same prompts (bench/bench_pipeline.py's --json).

    python bench/plot_acceptance.py FIGURES.json OUT.png [--title TEXT]

Needs matplotlib (the GPU machine has it; here: pip install matplotlib).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

SET_TITLES = {"holdout": "held-out chat, first turn", "holdout_turn2": "held-out chat, second turn",
              "humaneval": "HumanEval"}


def curves(figures: dict[str, Any]) -> dict[str, dict[str, list[tuple[int, float]]]]:
    """Per set, per method, the (k, acceptance length) points in k order; no_drafter as a flat line."""
    out: dict[str, dict[str, list[tuple[int, float]]]] = {}
    for name, one in figures["evaluation"].items():
        methods = {m: sorted((int(k), v) for k, v in one[m]["curve"].items()) for m in ("drafter", "lookup") if m in one}
        if "no_drafter" in one and methods:
            ks = [k for k, _ in next(iter(methods.values()))]
            methods["no_drafter"] = [(k, one["no_drafter"]["acceptance_length"]) for k in ks]
        out[name] = methods
    return out


def plot(figures: dict[str, Any], out: Path, title: str | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sets = curves(figures)
    fig, axes = plt.subplots(1, len(sets), figsize=(4.2 * len(sets), 3.6), sharey=True, squeeze=False)
    for ax, (name, methods) in zip(axes[0], sets.items()):
        drafter = "DFlash" if figures["evaluation"][name].get("drafter_method") == "dflash" else "EAGLE-3"
        styles = {"drafter": (f"drafter ({drafter})", "o-"), "lookup": ("prompt lookup", "s--"), "no_drafter": ("no drafter", ":")}
        for method, points in methods.items():
            label, style = styles[method]
            ax.plot([k for k, _ in points], [v for _, v in points], style, label=label)
        prompts = figures["evaluation"][name]["prompts"]
        ax.set_title(f"{SET_TITLES.get(name, name)} ({prompts} prompts)", fontsize=10)
        ax.set_xlabel("draft tokens per pass (k)")
        ax.set_xticks(sorted({k for points in methods.values() for k, _ in points}))
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("acceptance length (tokens per target pass)")
    axes[0][0].legend(fontsize=8)
    fig.suptitle(title or f"{figures.get('target', '')} on {figures.get('device', '')}", fontsize=11)
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("figures", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--title")
    args = parser.parse_args()
    plot(json.loads(args.figures.read_text()), args.out, args.title)


if __name__ == "__main__":
    main()
