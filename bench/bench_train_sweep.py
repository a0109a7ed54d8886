"""Training settings measured on a real target: the same hidden-state files trained several ways, each
drafter evaluated on the same sets as the source run.

From a finished run (``--run``, e.g. bench/bench_pipeline.py's) each ``--variant NAME=JSON`` makes a new
run on the same volume whose training settings are the source's with JSON's fields replaced, trains it,
exports it and evaluates the export on the source run's evaluation sets (its held-out rows, HumanEval with
the same overlap exclusion) with the source's evaluation settings, drafter only: the baselines do not
depend on the drafter and stay in the source run's eval.json. The files are hard-linked, never copied.
One JSON key is not a training setting: ``"storage": "fp8"`` rewrites the files as the extractor writes
them with ``extraction.storage = "fp8"`` (``quantize_fp8`` over the same bf16 states, so the same bytes
an fp8 extraction of the run would have written) instead of linking them.

    python bench/bench_train_sweep.py --data /tmp/bench-data --run bench-smollm2-5000 \\
        --model-dir /tmp/bench-data/models/smollm2 --device cuda --json sweep.json \\
        --variant 'fp8={"storage": "fp8"}' --variant 'lr1e-3={"lr": 1e-3}'

``"files": N`` trains the variant on N of the source's files (a fixed pick by a hash of the sample id; a
smaller pick is part of every larger one), the data-size axis of a recipe sweep.

A further key that is not a training setting: ``"measure": "one_pass"`` (or ``--one-pass`` for every variant
that does not say ``"measure": "decode"``) measures the variant by the one-pass curve instead of decoding
(evaluation/one_pass.py: the same acceptance but for rounding, from one target forward over
the greedy replies, which are computed once for every variant): seconds a variant instead of minutes, so a
sweep's device time goes to training. The source run's own export is measured the same way first, beside
the decoded curves of its eval.json, so the JSON shows how far the two forms lie apart on these prompts. Every
variant walks the same replies, so each set also holds its margin over the source's export (``over_source``) and
the source's over prompt lookup (``over_lookup``), per k, each with its paired bootstrap interval over the set's
prompts (evaluation/margin.py): whether a variant's gain is larger than another draw of prompts
would move it.

The JSON is rewritten after each variant, so a cut-short sweep keeps what it measured.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from services.inference.hidden import raw_states, stored_states  # noqa: E402
from services.trainer.data import list_hidden_files  # noqa: E402
from evaluation.evalsets import load_sets  # noqa: E402
from evaluation.evaluate import (  # noqa: E402
    DRAFTER,
    LOOKUP,
    evaluate_sets,
    exported_drafter,
    load_target,
    set_replays,
)
from evaluation.margin import paired_difference  # noqa: E402
from evaluation.one_pass import Counts, Replay, one_pass_counts  # noqa: E402
from modeling.export_method import export_dtype, export_trained  # noqa: E402
from services.trainer.train import train_drafter  # noqa: E402
from shared import eagle3  # noqa: E402
from shared.atomic import atomic_write_text  # noqa: E402
from shared.drafter_format import CONFIG_FILE, read_config  # noqa: E402
from shared.hidden_file import read_header, verify_hidden_file  # noqa: E402
from shared.hidden_write import RawTensor, write_safetensors  # noqa: E402
from shared.layout import RunPaths  # noqa: E402
from shared.runspec import RunSpec, TrainConfig  # noqa: E402

log = logging.getLogger(__name__)

STORAGE_KEY = "storage"  # how the variant's files store the states: linked as they are, or rewritten as fp8
MEASURE_KEY = "measure"  # how the variant's export is measured: decoded, or by the one-pass curve
FILES_KEY = "files"  # how many of the source's files the variant trains on (all by default): the data-size axis
SWEEP_KEYS = (STORAGE_KEY, MEASURE_KEY, FILES_KEY)  # the variant keys that are not TrainConfig fields


def train_fields(fields: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in fields.items() if k not in SWEEP_KEYS}


class BadVariant(ValueError):
    """A --variant that is not NAME=JSON object."""


def parse_variant(text: str) -> tuple[str, dict[str, Any]]:
    name, sep, body = text.partition("=")
    try:
        fields = json.loads(body) if sep else None
    except json.JSONDecodeError as exc:
        raise BadVariant(f"--variant {text!r}: {exc}") from exc
    if not name or not isinstance(fields, dict):
        raise BadVariant(f"--variant {text!r}: expected NAME={{json object}}")
    if fields.get(STORAGE_KEY, "target") not in ("target", "fp8"):
        raise BadVariant(f"--variant {text!r}: storage must be 'target' or 'fp8'")
    if fields.get(MEASURE_KEY, "decode") not in ("decode", "one_pass"):
        raise BadVariant(f"--variant {text!r}: measure must be 'decode' or 'one_pass'")
    count = fields.get(FILES_KEY)
    if count is not None and (isinstance(count, bool) or not isinstance(count, int) or count < 1):
        raise BadVariant(f"--variant {text!r}: files must be a whole number of files, at least 1")
    return name, fields


def file_subset(files: list[tuple[int, Path]], count: int | None) -> list[tuple[int, Path]]:
    """``count`` of ``files`` picked by a hash of the sample id (all of them when ``count`` is None), in sample
    order. The pick does not follow the dataset's order, and a smaller subset is part of every larger one, so
    the variants of a data-size sweep differ only in how much they add."""
    if count is None or count >= len(files):
        return list(files)
    # Not validation_split's sha256: with the same ranking every small pick would hold all the validation files.
    ranked = sorted(files, key=lambda item: hashlib.blake2b(str(item[0]).encode(), digest_size=8).digest())
    return sorted(ranked[:count])


def fp8_copy(source: Path, target: Path) -> None:
    """``source`` (a bf16 hidden-state file) rewritten with fp8 states and their scales, as the extractor
    writes them: the same ids, mask and metadata, the states through the production ``stored_states``."""
    header, _ = read_header(source)
    metadata = dict(header.get("__metadata__") or {})
    tensors = load_file(str(source))
    out: dict[str, RawTensor] = {
        eagle3.INPUT_IDS: RawTensor.of(tensors[eagle3.INPUT_IDS].numpy()),
        eagle3.LOSS_MASK: RawTensor.of(tensors[eagle3.LOSS_MASK].numpy()),
    }
    stored = stored_states(tensors[eagle3.AUX_HIDDEN], tensors[eagle3.LAST_HIDDEN], "fp8")
    out.update(raw_states(stored, "fp8", metadata.get(eagle3.META_DTYPE, "BF16")))
    write_safetensors(target, out, metadata)
    verify_hidden_file(target)


def make_variant(data: Path, source: RunSpec, name: str, fields: dict[str, Any]) -> RunSpec:
    """A run named ``name``: the source's files (linked, or fp8 copies) and its training settings with
    ``fields`` replaced."""
    train = train_fields(fields)
    # Validated as a run's settings are: a misspelt or out-of-range field fails here, naming it, before any file.
    spec = source.model_copy(update={"name": name, "train": TrainConfig.model_validate(
        {**source.train.model_dump(), **train})})
    fp8 = fields.get(STORAGE_KEY) == "fp8"
    paths = RunPaths(data, name)
    for sample_id, path in file_subset(list_hidden_files(RunPaths(data, source.name)), fields.get(FILES_KEY)):
        target = paths.hidden(sample_id)
        target.parent.mkdir(parents=True, exist_ok=True)
        if target.exists():
            continue
        if fp8:
            fp8_copy(path, target)
        else:
            os.link(path, target)
    spec.save(data)
    return spec


def hidden_bytes(paths: RunPaths) -> int:
    return sum(path.stat().st_size for _, path in list_hidden_files(paths))


def accepted_per_forward(curve: dict[str, float], method: str) -> dict[str, float]:
    """Accepted drafts per drafter forward at each k: an EAGLE-3 chain runs k forwards a pass, a DFlash block
    one (its context projection rides along); a pass accepts acceptance length - 1 drafts."""
    return {k: (value - 1) / (int(k) if method == "eagle3" else 1) for k, value in curve.items()}


def one_pass_sets(target: Any, drafter: Any, replays: dict[str, list[Replay]], cfg: Any, method: str,
                  lookup: tuple[int, int] | None = None,
                  baseline: dict[str, Counts] | None = None) -> tuple[dict[str, Any], dict[str, Counts]]:
    """Per set, the drafter's one-pass curve at k = 1 .. curve_max_steps over the set's greedy replies; with
    ``lookup`` ((min_n, max_n)) prompt lookup's over the same replies (``lookup_curve``) and the drafter's
    margin over it (``over_lookup``); with ``baseline`` (another drafter's counts on the same replies) the
    margin over that one (``over_source``); each margin with its interval over the set's prompts. And the
    drafter's counts per set, a later variant's baseline."""
    found, drafted = {}, {}
    for set_name, one in replays.items():
        started = time.monotonic()
        counts = one_pass_counts(target, one, {DRAFTER: drafter}, cfg.chain_lengths, batch_tokens=cfg.batch_tokens,
                                 lookup=lookup)
        curve = counts[DRAFTER].curve()
        found[set_name] = {"prompts": len(one), "measured_by": "one_pass", "curve": curve,
                           "accepted_per_drafter_forward": accepted_per_forward(curve, method),
                           "seconds": round(time.monotonic() - started, 1)}
        if lookup is not None:
            found[set_name]["lookup_curve"] = counts[LOOKUP].curve()
            found[set_name]["over_lookup"] = margins(counts[DRAFTER], counts[LOOKUP])
        if baseline is not None:
            found[set_name]["over_source"] = margins(counts[DRAFTER], baseline[set_name])
        drafted[set_name] = counts[DRAFTER]
    return found, drafted


def margins(mine: Counts, theirs: Counts) -> dict[str, Any]:
    """k -> acceptance length of ``mine`` minus ``theirs`` over the same replies, with its interval (margin.py)."""
    return {str(k): paired_difference(mine.replies[k], theirs.replies[k]) for k in sorted(mine.replies)}


def run_variant(data: Path, source: RunSpec, name: str, fields: dict[str, Any], model_dir: Path, device: str,
                target: Any, tokenizer: Any, replays: dict[str, list[Replay]] | None = None,
                baseline: dict[str, Counts] | None = None) -> dict[str, Any]:
    started = time.monotonic()
    spec = make_variant(data, source, name, fields)
    prepared = time.monotonic()
    result = train_drafter(spec, data=data, model_dir=model_dir, device=device)
    paths = RunPaths(data, name)
    # In the target's dtype, as the run's trainer exports: a variant then differs from the source in its
    # training alone (a bf16 export beside the source's float32 one rounded every variant's weights).
    export_trained(result.drafter, paths.export_dir, target_model=result.target_model,
                   target_fingerprint=result.target_fingerprint, dtype=export_dtype(model_dir))
    trained = time.monotonic()
    last = result.last
    figures: dict[str, Any] = {
        "fields": fields, "train": spec.train.model_dump(mode="json"), "files": result.num_files,
        "hidden_bytes": hidden_bytes(paths), "steps": result.steps, "prepare_s": round(prepared - started, 1),
        "train_s": round(trained - prepared, 1), "export_dtype": read_config(paths.export_dir)["torch_dtype"],
        "loss": None if last is None else last.loss,
        "acc": None if last is None else last.acc, "sets": {},
    }
    del result
    if device == "cuda":
        torch.cuda.empty_cache()
    drafter = exported_drafter(target, model_dir, paths.export_dir)
    cfg = source.evaluate.model_copy(update={"baselines": False})
    if replays is not None:
        figures["sets"], _ = one_pass_sets(target, drafter, replays, cfg, spec.train.method, baseline=baseline)
        figures["evaluate_s"] = round(time.monotonic() - trained, 1)
        return figures
    source_paths = RunPaths(data, source.name)
    sets = load_sets(cfg, eval_prompts=source_paths.eval_prompts, train_prompts=source_paths.prompts,
                     turns=source.generation.turns)
    report = evaluate_sets(target, tokenizer, drafter, sets, cfg)
    for set_name, one in report["sets"].items():
        check = one["greedy_check"]
        curve = one["methods"]["drafter"]["curve"]
        figures["sets"][set_name] = {"prompts": len(one["prompts"]), "measured_by": "decode", "curve": curve,
                                     "one_pass_curve": one["methods"]["drafter"]["one_pass"]["curve"],
                                     "accepted_per_drafter_forward": accepted_per_forward(curve, one["drafter_method"]),
                                     "greedy_checked": check["checked"], "greedy_matched": check["matched"],
                                     "mismatches": len(check["mismatches"]), "seconds": one["seconds"]}
    figures["evaluate_s"] = round(time.monotonic() - trained, 1)
    return figures


def measure_source(figures: dict[str, Any], data: Path, source: RunSpec, model_dir: Path, target: Any,
                   tokenizer: Any) -> tuple[dict[str, list[Replay]], dict[str, Counts]]:
    """The run's sets as greedy replies, once for every variant, and the run's own export measured by one pass
    beside its eval.json's decoded curves (where the run's evaluation has written them): the replies, and the
    export's counts on them that every variant is set beside."""
    paths = RunPaths(data, source.name)
    cfg = source.evaluate.model_copy(update={"baselines": False})
    started = time.monotonic()
    sets = load_sets(cfg, eval_prompts=paths.eval_prompts, train_prompts=paths.prompts, turns=source.generation.turns)
    replays = {one.name: set_replays(target, tokenizer, one.prompts, cfg) for one in sets}
    figures["one_pass"] = {"replays_s": round(time.monotonic() - started, 1),
                           "prompts": {name: len(one) for name, one in replays.items()}}
    drafter = exported_drafter(target, model_dir, paths.export_dir)
    # Prompt lookup too (its one pass costs no target forward): the margin the run is judged by stands in this JSON
    # even where the run's own decoded evaluation has not finished.
    measured, counts = one_pass_sets(target, drafter, replays, cfg, source.train.method,
                                     lookup=(cfg.lookup_min, cfg.lookup_max))
    decoded = json.loads(paths.eval_report.read_text())["sets"] if paths.eval_report.exists() else {}
    for set_name, one in measured.items():
        methods = decoded.get(set_name, {}).get("methods", {})
        apart = []
        for mine, theirs, method in (("curve", "decoded_curve", DRAFTER), ("lookup_curve", "decoded_lookup_curve", LOOKUP)):
            curve = methods.get(method, {}).get("curve")
            if curve:
                one[theirs] = curve
                apart += [abs(one[mine][k] - curve[k]) for k in one[mine] if k in curve]
        if apart:
            one["apart"] = max(apart)
    figures["one_pass"]["source"] = measured
    log.info("source run %s by one pass: %s", source.name, json.dumps({s: v["curve"] for s, v in measured.items()}))
    return replays, counts


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, required=True)
    parser.add_argument("--run", required=True, help="a finished run whose hidden-state files are reused")
    parser.add_argument("--model-dir", type=Path, required=True)
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--variant", action="append", required=True, metavar="NAME=JSON",
                        help="training settings to replace (repeatable); 'storage': 'fp8' rewrites the files as fp8, "
                             "'measure': 'one_pass' measures the variant by one pass")
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--one-pass", action="store_true",
                        help="measure by the one-pass curve on the run's sets, instead of decoding, every variant that "
                             "does not say \"measure\": \"decode\"")
    args = parser.parse_args(argv)
    try:
        variants = [parse_variant(text) for text in args.variant]
    except BadVariant as exc:
        parser.error(str(exc))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    data = args.data.resolve()
    source = RunSpec.load(data, args.run)
    for name, fields in variants:  # every variant's settings checked before the first one trains
        try:
            TrainConfig.model_validate({**source.train.model_dump(), **train_fields(fields)})
        except ValueError as exc:
            parser.error(f"--variant {name}: {exc}")
    target, tokenizer = load_target(args.model_dir, torch.device(args.device))
    stamp = time.strftime("%H%M%S")
    figures: dict[str, Any] = {"date": time.strftime("%Y-%m-%d"), "source_run": source.name,
                               "source_train": source.train.model_dump(mode="json"),
                               "source_hidden_bytes": hidden_bytes(RunPaths(data, source.name)),
                               "evaluate": source.evaluate.model_dump(mode="json"), "variants": {}}
    source_export = RunPaths(data, source.name).export_dir
    if (source_export / CONFIG_FILE).exists():  # each variant's export_dtype must equal it
        figures["source_export_dtype"] = read_config(source_export)["torch_dtype"]
    default = "one_pass" if args.one_pass else "decode"
    measures = {name: fields.get(MEASURE_KEY, default) for name, fields in variants}
    replays = baseline = None
    if "one_pass" in measures.values():
        replays, baseline = measure_source(figures, data, source, args.model_dir, target, tokenizer)
        atomic_write_text(args.json, json.dumps(figures, indent=2) + "\n")
    for name, fields in variants:
        log.info("variant %s: %s", name, json.dumps(fields))
        figures["variants"][name] = run_variant(data, source, f"sweep-{stamp}-{name}", fields, args.model_dir,
                                                args.device, target, tokenizer,
                                                *((replays, baseline) if measures[name] == "one_pass" else ()))
        atomic_write_text(args.json, json.dumps(figures, indent=2) + "\n")
        log.info("variant %s: %s", name, json.dumps({s: v["curve"] for s, v in figures["variants"][name]["sets"].items()}))
    mismatched = {name: v["sets"] for name, v in figures["variants"].items()
                  if any(s.get("mismatches") for s in v["sets"].values())}
    if mismatched:
        raise SystemExit(f"speculative output differed from greedy in variants {sorted(mismatched)} (see {args.json})")


if __name__ == "__main__":
    main()
