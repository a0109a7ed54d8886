"""More than one reply per prompt (``generation.replies``): the id scheme, how each reply is asked, and the
settings refused by name."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from shared.layout import RunPaths
from shared.runspec import GenerationConfig, RunSpec


def spec_of(rows: int, prompt_rows: int, replies: int) -> RunSpec:
    """A run of ``rows`` dataset rows, the first held out at ``prompt_rows``, as submission saves it."""
    extra = (replies - 1) * prompt_rows
    return RunSpec(name="r", dataset="d", model="m", rows=rows + extra, train_ids=prompt_rows + extra,
                   generation=GenerationConfig(replies=replies))


def test_replies_above_one_at_temperature_zero_are_refused_by_name():
    with pytest.raises(ValidationError, match="generation.replies 3 with generation.reply_temperature 0"):
        GenerationConfig(replies=3, reply_temperature=0)
    assert GenerationConfig(replies=1, reply_temperature=0).replies == 1  # one reply samples nothing: not read


@pytest.mark.parametrize("field, value", [("replies", 0), ("reply_temperature", -0.5), ("reply_top_p", 0),
                                          ("reply_top_p", 1.5)])
def test_out_of_range_reply_settings_are_refused(field, value):
    with pytest.raises(ValidationError, match=field):
        GenerationConfig(**{"replies": 2, field: value})


def test_with_one_reply_every_sample_id_is_its_row_index():
    generation = GenerationConfig()
    spec = spec_of(rows=12, prompt_rows=9, replies=1)
    assert [generation.sample_id(row, 9) for row in range(12)] == list(range(12))
    assert [spec.reply_of(i) for i in range(12)] == [(i, 0) for i in range(12)]
    assert (spec.rows, spec.train_ids, spec.prompt_rows) == (12, 9, 9)


@pytest.mark.parametrize("replies", [2, 3, 5])
def test_each_reply_of_each_row_has_one_id_and_reply_of_names_it_back(replies):
    rows, prompt_rows = 12, 9  # rows 9, 10, 11 held out
    spec = spec_of(rows, prompt_rows, replies)
    generation = spec.generation
    trained = {(row, r): generation.sample_id(row, prompt_rows, r) for row in range(prompt_rows) for r in range(replies)}
    later = {(row, 0): generation.sample_id(row, prompt_rows) for row in range(prompt_rows, rows)}
    ids = {**trained, **later}
    assert sorted(ids.values()) == list(range(spec.rows))  # every id once, none missing
    assert max(trained.values()) < spec.train_ids <= min(later.values())  # held-out ids above every trained one
    assert all(trained[row, 0] == row for row in range(prompt_rows))  # a row's own reply keeps its row index
    assert {spec.reply_of(i): i for i in range(spec.rows)} == ids


def test_a_later_row_has_no_sampled_reply_and_a_reply_beyond_replies_none_at_all():
    generation = GenerationConfig(replies=3)
    with pytest.raises(ValueError, match="row 10 comes after the first held-out row"):
        generation.sample_id(10, 9, reply=1)
    with pytest.raises(ValueError, match="reply 3 of a run with generation.replies 3"):
        generation.sample_id(0, 9, reply=3)


def test_a_sampled_reply_is_asked_at_reply_temperature_and_the_rows_own_as_the_run_says():
    generation = GenerationConfig(replies=3, temperature=0.0, top_p=1.0, reply_temperature=0.8, reply_top_p=0.95)
    assert generation.for_reply(0) is generation
    sampled = generation.for_reply(2)
    assert (sampled.temperature, sampled.top_p) == (0.8, 0.95)
    assert (sampled.max_tokens, sampled.seed, sampled.turns) == (generation.max_tokens, generation.seed, "all")
    assert generation.reply_label(4, 0) == "" and generation.reply_label(4, 2) == "row 4, sampled reply 2 of 2: "


def test_a_run_json_from_before_replies_loads_with_one_reply(tmp_path):
    raw = RunSpec(name="old", dataset="d.jsonl", model="m", rows=5, train_ids=4).model_dump(mode="json")
    for field in ("replies", "reply_temperature", "reply_top_p"):
        del raw["generation"][field]
    path = RunPaths(tmp_path, "old").spec
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(raw))
    spec = RunSpec.load(tmp_path, "old")
    assert spec.generation.replies == 1 and spec.prompt_rows == 4
    assert [spec.reply_of(i) for i in range(5)] == [(i, 0) for i in range(5)]
