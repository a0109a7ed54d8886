"""The acceptance curve of a pipeline benchmark as a PNG: one panel per evaluation set, acceptance length
against the chain length k for the drafter and prompt lookup, and the no-drafter line, all measured in the
same run on the same prompts (bench/bench_pipeline.py's --json). ``--sweep`` adds the drafters that
bench/bench_train_sweep.py trained from the same run's files and evaluated on the same sets (DFlash beside
the run's EAGLE-3, say), one line each. Where the run held files out of training (train.validation_files), a
last panel draws their one-pass acceptance at each checkpoint against the training step, one line per k.

    python bench/plot_acceptance.py FIGURES.json OUT.png [--sweep SWEEP.json ...] [--title TEXT]

Needs matplotlib (the GPU machine has it; here: pip install matplotlib).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

SET_TITLES = {"holdout": "held-out chat, first turn", "holdout_turn2": "held-out chat, second turn",
              "humaneval": "HumanEval"}


METHOD_NAMES = {"eagle3": "EAGLE-3", "dflash": "DFlash"}


def method_name(method: str | None) -> str:
    """How the plot names a drafter method (a report without one is EAGLE-3's, from before methods)."""
    return METHOD_NAMES.get(method or "eagle3", method or "eagle3")


def points(curve: dict[str, float]) -> list[tuple[int, float]]:
    return sorted((int(k), v) for k, v in curve.items())


def curves(figures: dict[str, Any], sweeps: tuple[dict[str, Any], ...] = ()) -> dict[str, dict[str, list[tuple[int, float]]]]:
    """Per set, per line, the (k, acceptance length) points in k order: the run's drafter and prompt lookup, no
    drafter as a flat line, then every swept variant evaluated on that set, keyed ``sweep:NAME (METHOD)``."""
    out: dict[str, dict[str, list[tuple[int, float]]]] = {}
    for name, one in figures["evaluation"].items():
        methods = {m: points(one[m]["curve"]) for m in ("drafter", "lookup") if m in one}
        if "no_drafter" in one and methods:
            ks = [k for k, _ in next(iter(methods.values()))]
            methods["no_drafter"] = [(k, one["no_drafter"]["acceptance_length"]) for k in ks]
        for sweep in sweeps:
            for variant, swept in sweep["variants"].items():
                if name in swept["sets"]:
                    methods[f"sweep:{variant} ({method_name(swept['train'].get('method'))})"] = points(swept["sets"][name]["curve"])
        out[name] = methods
    return out


def held_out_lines(figures: dict[str, Any]) -> dict[str, list[tuple[int, float]]]:
    """Per k, the (training step, held-out one-pass acceptance) points of the run's checkpoints, in step order."""
    out: dict[str, list[tuple[int, float]]] = {}
    for point in sorted(figures.get("validation_curve") or [], key=lambda p: p["step"]):
        for k, value in point.get("curve", {}).items():  # a checkpoint whose measurement failed has none
            out.setdefault(k, []).append((point["step"], value))
    return dict(sorted(out.items(), key=lambda item: int(item[0])))


def plot(figures: dict[str, Any], out: Path, title: str | None = None, sweeps: tuple[dict[str, Any], ...] = ()) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sets, held_out = curves(figures, sweeps), held_out_lines(figures)
    panels = len(sets) + (1 if held_out else 0)
    fig, axes = plt.subplots(1, panels, figsize=(4.2 * panels, 3.6), sharey=True, squeeze=False)
    for ax, (name, methods) in zip(axes[0], sets.items()):
        drafter = method_name(figures["evaluation"][name].get("drafter_method"))
        styles = {"drafter": (f"drafter ({drafter})", "o-"), "lookup": ("prompt lookup", "s--"), "no_drafter": ("no drafter", ":")}
        for method, line in methods.items():
            label, style = styles.get(method, (method.removeprefix("sweep:"), "^-"))
            ax.plot([k for k, _ in line], [v for _, v in line], style, label=label)
        prompts = figures["evaluation"][name]["prompts"]
        ax.set_title(f"{SET_TITLES.get(name, name)} ({prompts} prompts)", fontsize=10)
        ax.set_xlabel("draft tokens per pass (k)")
        ax.set_xticks(sorted({k for points in methods.values() for k, _ in points}))
        ax.grid(alpha=0.3)
    if held_out:
        ax = axes[0][-1]
        for k, line in held_out.items():
            ax.plot([step for step, _ in line], [v for _, v in line], ".-", label=f"k = {k}")
        files = next(p["files"] for p in reversed(figures["validation_curve"]) if "files" in p)
        ax.set_title(f"held-out files ({files}), one pass, while training", fontsize=10)
        ax.set_xlabel("training step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    axes[0][0].set_ylabel("acceptance length (tokens per target pass)")
    axes[0][0].legend(fontsize=8)
    fig.suptitle(title or f"{figures.get('target', '')} on {figures.get('device', '')}", fontsize=11)
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("figures", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--sweep", type=Path, action="append", default=[],
                        help="bench_train_sweep.py's --json of variants trained from this run's files (repeatable)")
    parser.add_argument("--title")
    args = parser.parse_args()
    for path in (args.figures, *args.sweep):
        if not path.is_file():
            parser.error(f"{path}: no such file")
    sweeps = tuple(json.loads(path.read_text()) for path in args.sweep)
    plot(json.loads(args.figures.read_text()), args.out, args.title, sweeps)


if __name__ == "__main__":
    main()
