"""Run settings: run.json files written before a setting existed still load, with today's meaning."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from shared.layout import RunPaths
from shared.runspec import EvalConfig, ExtractionConfig, GenerationConfig, RunSpec, TrainConfig

# The train section as run.json held it before max_length could be unset and batches grouped by length.
OLD_TRAIN = {"epochs": 2, "batch_size": 4, "lr": 1e-4, "warmup_ratio": 0.05, "grad_clip": 0.5, "ttt_steps": 7,
             "max_length": 2048, "draft_vocab_size": 32000, "seed": 0, "save_every": 200, "base_checkpoint": None}


def test_an_old_run_json_loads_and_keeps_the_max_length_it_names(tmp_path):
    spec = RunSpec(name="old", dataset="d.jsonl", model="m").model_dump(mode="json")
    spec["train"] = OLD_TRAIN
    path = RunPaths(tmp_path, "old").spec
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(spec))
    loaded = RunSpec.load(tmp_path, "old")
    assert loaded.train.max_length == 2048 and loaded.train_max_length == 2048
    assert loaded.train.max_tokens is None and loaded.train.group_by_length


def test_an_unset_max_length_trains_on_what_extraction_keeps():
    assert RunSpec(name="r", dataset="d", model="m").train_max_length == 4096
    spec = RunSpec(name="r", dataset="d", model="m", extraction=ExtractionConfig(max_length=1000))
    assert spec.train_max_length == 1000
    assert spec.model_copy(update={"train": TrainConfig(max_length=512)}).train_max_length == 512


@pytest.mark.parametrize("field", ["max_length", "max_tokens"])
def test_lengths_below_eight_tokens_are_refused(field):
    with pytest.raises(ValidationError, match=field):
        TrainConfig(**{field: 4})


def test_a_global_batch_and_a_token_budget_are_not_set_together():
    with pytest.raises(ValidationError, match="global_batch_size and max_tokens both size a batch"):
        TrainConfig(global_batch_size=64, max_tokens=8192)
    assert TrainConfig(global_batch_size=64).global_batch_size == 64



def test_a_run_json_from_before_the_evaluation_sets_loads_with_their_defaults(tmp_path):
    paths = RunPaths(tmp_path, "old")
    paths.root.mkdir(parents=True)
    # The evaluate section as runs stored it before sets, curve and baselines existed.
    old = {"name": "old", "dataset": "d.jsonl", "model": "m",
           "evaluate": {"holdout": 5, "max_new_tokens": 32, "draft_steps": 2}}
    paths.spec.write_text(json.dumps(old))
    cfg = RunSpec.load(tmp_path, "old").evaluate
    assert (cfg.holdout, cfg.max_new_tokens, cfg.draft_steps) == (5, 32, 2)
    assert cfg.sets == ["holdout", "humaneval"] and cfg.humaneval_limit is None
    assert cfg.curve_max_steps == 7 and cfg.baselines is True and (cfg.lookup_min, cfg.lookup_max) == (2, 5)


@pytest.mark.parametrize("bad", [{"sets": ["holdout", "holdout"]}, {"sets": []}, {"sets": ["mmlu"]},
                                 {"lookup_min": 4, "lookup_max": 3}, {"curve_max_steps": 0}, {"humaneval_limit": 0},
                                 {"unknown": 1}])
def test_evaluation_settings_that_cannot_mean_anything_are_refused(bad):
    with pytest.raises(ValidationError):
        EvalConfig(**bad)


def test_a_run_json_from_before_generation_turns_keeps_regenerating_the_last_turn_only(tmp_path):
    """A run submitted before the setting answered the last turn only: resumed, it must not change its mind."""
    spec = RunSpec(name="old", dataset="d.jsonl", model="m").model_dump(mode="json")
    del spec["generation"]["turns"]
    path = RunPaths(tmp_path, "old").spec
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(spec))
    assert RunSpec.load(tmp_path, "old").generation.turns == "last"
    assert RunSpec(name="new", dataset="d.jsonl", model="m").generation.turns == "all"
    RunSpec(name="new", dataset="d.jsonl", model="m").save(tmp_path)
    assert RunSpec.load(tmp_path, "new").generation.turns == "all"


def test_second_turns_are_evaluated_only_where_the_target_wrote_the_first():
    turn2 = EvalConfig(sets=["holdout", "holdout_turn2"])
    RunSpec(name="r", dataset="d", model="m", evaluate=turn2)  # turns "all", the default
    with pytest.raises(ValidationError, match='holdout_turn2 needs generation.turns = "all"'):
        RunSpec(name="r", dataset="d", model="m", generation=GenerationConfig(turns="last"), evaluate=turn2)


def test_the_loss_and_the_normalized_features_round_trip_through_run_json(tmp_path):
    train = TrainConfig(loss="lk_lambda", lk_eta=2.0, aux_norm=True)
    RunSpec(name="lk", dataset="d", model="m", train=train).save(tmp_path)
    loaded = RunSpec.load(tmp_path, "lk").train
    assert (loaded.loss, loaded.lk_eta, loaded.aux_norm) == ("lk_lambda", 2.0, True)
    assert TrainConfig.model_validate({**train.model_dump(), "loss": "lk_alpha"}).loss == "lk_alpha"


def test_a_run_json_from_before_the_options_trains_as_it_did(tmp_path):
    spec = RunSpec(name="old", dataset="d.jsonl", model="m").model_dump(mode="json")
    spec["train"] = OLD_TRAIN
    path = RunPaths(tmp_path, "old").spec
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(spec))
    loaded = RunSpec.load(tmp_path, "old").train
    assert (loaded.loss, loaded.aux_norm) == ("kl", False)


@pytest.mark.parametrize(("settings", "named"), [
    ({"loss": "tv"}, "loss"),
    ({"loss": "LK"}, "loss"),
    ({"lk_loss_type": "lambda"}, "lk_loss_type"),  # a peer's name for the setting is not ours
    ({"fc_norm": True}, "fc_norm"),  # the export's key, not the train setting
    ({"lk_eta": 0}, "lk_eta"),
    ({"aux_norm": "yes please"}, "aux_norm"),
])
def test_unknown_loss_names_settings_and_values_are_refused_by_name(settings, named):
    with pytest.raises(ValidationError, match=named):
        TrainConfig(**settings)


def test_normalized_features_are_refused_where_no_engine_would_serve_them():
    with pytest.raises(ValidationError, match="aux_norm is the EAGLE-3 drafter's fc_norm.*qwen3_dflash"):
        TrainConfig(method="dflash", aux_norm=True)
    with pytest.raises(ValidationError, match="aux_norm with a base_checkpoint"):
        TrainConfig(aux_norm=True, base_checkpoint="published/drafter")
    assert TrainConfig(method="dflash", loss="lk_alpha").loss == "lk_alpha"  # the losses train either drafter
