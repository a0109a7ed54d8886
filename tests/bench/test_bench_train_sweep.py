"""The sweep's variant syntax: training settings plus the keys that are not (storage, measure, files), each
misspelling refused by name before anything trains (the sweep itself runs in test_bench_pipeline)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.bench_train_sweep import BadVariant, file_subset, parse_variant, train_fields


def test_a_variant_is_a_name_and_a_json_object_of_settings():
    name, fields = parse_variant('lr1e-3={"lr": 1e-3, "measure": "one_pass", "storage": "fp8"}')
    assert name == "lr1e-3" and fields == {"lr": 1e-3, "measure": "one_pass", "storage": "fp8"}
    assert train_fields(fields) == {"lr": 1e-3}  # what the variant's TrainConfig is built from
    assert train_fields(parse_variant('half={"files": 8000, "epochs": 4}')[1]) == {"epochs": 4}


@pytest.mark.parametrize("text, named", [
    ('x={"measure": "onepass"}', "measure must be"),
    ('x={"storage": "fp4"}', "storage must be"),
    ('x={"files": 0}', "files must be"),
    ('x={"files": "4000"}', "files must be"),
    ('x={"files": 0.5}', "files must be"),
    ('x=[1]', "expected NAME="),
    ('={"lr": 1}', "expected NAME="),
    ('x={"lr": }', "x="),
])
def test_a_bad_variant_is_refused_naming_it(text, named):
    with pytest.raises(BadVariant, match=named):
        parse_variant(text)


def test_a_data_size_pick_is_fixed_spread_over_the_dataset_and_nested():
    files = [(i, Path(f"{i:08d}.safetensors")) for i in range(1000)]
    half, quarter = file_subset(files, 500), file_subset(files, 250)
    assert len(half) == 500 and len(quarter) == 250
    assert half == sorted(half) and half == file_subset(list(reversed(files)), 500)  # the same pick, in sample order
    assert set(quarter) <= set(half)  # a data-size sweep adds files; it never swaps them
    assert half != files[:500] and max(i for i, _ in quarter) > 900  # not the dataset's first rows
    assert file_subset(files, None) == files and file_subset(files, 5000) == files
