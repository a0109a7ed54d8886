"""The sweep's variant syntax: training settings plus the two keys that are not (storage, measure), each
misspelling refused by name before anything trains (the sweep itself runs in test_bench_pipeline)."""

from __future__ import annotations

import pytest

from bench.bench_train_sweep import BadVariant, parse_variant, train_fields


def test_a_variant_is_a_name_and_a_json_object_of_settings():
    name, fields = parse_variant('lr1e-3={"lr": 1e-3, "measure": "one_pass", "storage": "fp8"}')
    assert name == "lr1e-3" and fields == {"lr": 1e-3, "measure": "one_pass", "storage": "fp8"}
    assert train_fields(fields) == {"lr": 1e-3}  # what the variant's TrainConfig is built from


@pytest.mark.parametrize("text, named", [
    ('x={"measure": "onepass"}', "measure must be"),
    ('x={"storage": "fp4"}', "storage must be"),
    ('x=[1]', "expected NAME="),
    ('={"lr": 1}', "expected NAME="),
    ('x={"lr": }', "x="),
])
def test_a_bad_variant_is_refused_naming_it(text, named):
    with pytest.raises(BadVariant, match=named):
        parse_variant(text)
