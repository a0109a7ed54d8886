"""The sweep's Markdown table: the source and lookup first per set, each variant with what it changed and its
margin over the source at the chosen k (the figures' shape is bench_train_sweep's, pinned in test_bench_pipeline)."""

from __future__ import annotations

import json

import pytest

from bench.sweep_table import main, table


def margin(difference: float) -> dict:
    return {"difference": difference, "low": difference - 0.05, "high": difference + 0.05, "prompts": 9,
            "level": 0.95, "draws": 2000}


def sweep(variants: dict, run: str = "bench") -> dict:
    return {"source_run": run, "variants": variants, "one_pass": {"source": {"holdout": {
        "curve": {"1": 1.5, "3": 1.9}, "lookup_curve": {"1": 1.2, "3": 1.39},
        "over_lookup": {"1": margin(0.3), "3": margin(0.51)}}}}}


def variant(curve_3: float) -> dict:
    return {"fields": {"lr": 1e-3, "epochs": 3, "measure": "one_pass"}, "files": 16755, "steps": 3144, "train_s": 561.0,
            "sets": {"holdout": {"curve": {"1": 1.55, "3": curve_3}, "over_source": {"1": margin(0.05),
                                                                                  "3": margin(curve_3 - 1.9)}}}}


def test_rows_per_set_source_and_lookup_first_then_each_variant_with_its_margin():
    lines = table([sweep({"epochs3": variant(2.0)}), sweep({"seed1": variant(1.88)})], "3")
    assert lines[0] == ("| set | drafter | changed | files | steps | training | k = 1 | k = 3 | "
                        "over the source at k = 3 (95%) |")
    assert lines[2] == "| holdout | the run's export | | | | | 1.50 | 1.90 | over lookup +0.51 (+0.46 to +0.56) |"
    assert lines[3] == "| holdout | prompt lookup | | | | | 1.20 | 1.39 | |"
    assert lines[4] == ("| holdout | epochs3 | lr 0.001, epochs 3 | 16,755 | 3,144 | 9.3 min | 1.55 | 2.00 | "
                        "+0.10 (+0.05 to +0.15) |")
    assert lines[5].startswith("| holdout | seed1 |") and lines[5].endswith("| -0.02 (-0.07 to +0.03) |")
    assert len(lines) == 6


def test_sweeps_of_different_runs_are_refused(tmp_path, capsys):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(sweep({"x": variant(2.0)})))
    b.write_text(json.dumps(sweep({"y": variant(2.0)}, run="other")))
    with pytest.raises(SystemExit):
        main([str(a), str(b)])
    assert "different source runs" in capsys.readouterr().err
    main([str(a), "--k", "1"])
    assert "| +0.05 (+0.00 to +0.10) |" in capsys.readouterr().out


def test_a_margin_over_too_few_prompts_says_it_has_no_interval():
    few = variant(2.0)
    few["sets"]["holdout"]["over_source"]["3"] = {"difference": 0.1, "low": None, "high": None, "prompts": 4}
    assert table([sweep({"x": few})], "3")[4].endswith("| +0.10 (no interval: 4 prompts) |")


def test_a_sweep_cut_short_before_any_figure_gives_the_header_alone():
    assert len(table([{"source_run": "bench", "variants": {}}], "3")) == 2
