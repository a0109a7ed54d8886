"""Fine-tuning from a published drafter: each layout loads and trains on the tiny target, a base that does
not fit the target stops the run by name before training, and the base's vocabulary mapping is kept."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from safetensors.torch import load_file

from modeling.export import export_drafter, load_drafter
from services.trainer.drafter_init import VOCAB_FROM_BASE, VOCAB_FROM_DATA
from services.trainer.train import train_drafter
from services.trainer.vocab import build_mapping, count_tokens
from shared.errors import BaseCheckpointMismatch, CheckpointFormatError
from shared.layout import RunPaths
from shared.runspec import RunSpec
from runtime.runstate import RunState
from tests.support.published_drafter import BOTH, NONE, SGLANG, VLLM, YARN, Published, published_mapping, write_published_drafter

ONE_STEP = {"epochs": 1, "batch_size": 16, "save_every": 1000}  # 16 training files: one optimizer step
BASE = "published/drafter"


def train(paths, model_dir, **kwargs):
    return train_drafter(RunSpec.load(paths.data, paths.run), data=paths.data, model_dir=model_dir, device="cpu", **kwargs)


def publish(data_dir, tiny_model_dir, **fields):
    return write_published_drafter(data_dir / BASE, tiny_model_dir, Published(**fields))


@pytest.mark.parametrize(("convention", "mapping"), [
    (SGLANG, ("d2t", "t2d")),
    (VLLM, ("d2t", "t2d")),
    (NONE, ("d2t",)),
    (BOTH, ()),
    (VLLM, ()),
])
def test_a_published_drafter_loads_and_fine_tunes_a_step(make_run, tiny_model_dir, data_dir, tmp_path, caplog, convention, mapping):
    base = publish(data_dir, tiny_model_dir, convention=convention, mapping=mapping)
    paths = make_run("tuned", train={**ONE_STEP, "base_checkpoint": BASE})
    with caplog.at_level(logging.INFO, logger="services.trainer"):
        result = train(paths, tiny_model_dir)
    assert result.steps == 1 and result.layer_ids == [1, 3, 4]
    config = result.drafter.config
    assert config.rope_scaling == YARN and config.max_position_embeddings == 131072 and config.rope_theta == 500000.0
    exported = json.loads((export_drafter(result.drafter, tmp_path / "export", target_model="tiny", target_fingerprint="f",
                                          dtype=torch.bfloat16) / "config.json").read_text())
    assert exported["rope_scaling"] == YARN and exported["max_position_embeddings"] == 131072
    assert exported["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]
    assert exported["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]  # mapped once, back to vLLM's terms
    weights = load_file(tmp_path / "export" / "model.safetensors")
    if mapping:
        d2t, t2d = published_mapping(774, 128)
        assert torch.equal(weights["d2t"], d2t) and torch.equal(weights["t2d"], t2d)  # the base's, not the data's
        assert result.draft_vocab == VOCAB_FROM_BASE and "keeping its draft vocabulary of 128" in caplog.text
    else:
        files = sorted(paths.hidden_dir.rglob("*.safetensors"))
        d2t, t2d = build_mapping(count_tokens(files, 774), 128)
        assert torch.equal(weights["d2t"], d2t) and torch.equal(weights["t2d"], t2d)
        assert result.draft_vocab == VOCAB_FROM_DATA
        assert "it has no d2t/t2d, so its draft vocabulary of 128 is computed from this run's 16 training files" in caplog.text
    assert not torch.equal(result.drafter.fc.weight.detach(), load_file(base / "model.safetensors")["fc.weight"].float())


def test_a_published_drafter_loads_with_its_bf16_weights_and_the_targets_embedding(tiny_model_dir, tmp_path):
    from modeling.target_head import load_target_head

    base = write_published_drafter(tmp_path / "base", tiny_model_dir, Published(convention=VLLM))
    drafter = load_drafter(base, tiny_model_dir)
    stored = load_file(base / "model.safetensors")
    for name, tensor in drafter.export_state().items():
        assert torch.equal(tensor, stored[name].float() if stored[name].is_floating_point() else stored[name]), name
    assert torch.equal(drafter.embed_tokens.weight, load_target_head(tiny_model_dir).embed)  # not the drafter's own copy
    assert drafter.config.layer_ids == (1, 3, 4)  # vLLM's [2, 4, 5] in our terms


MISMATCHES = [
    ({"hidden_size": 32}, "hidden_size is 32, the target's hidden_size is 64"),
    ({"target_hidden_size": 128}, "target_hidden_size is 128, the target's hidden_size is 64"),
    ({"vocab_size": 800}, "vocab_size is 800, the target's vocab_size is 774"),
    ({"convention": VLLM, "layer_ids": [1, 3, 8]},
     "eagle_aux_hidden_state_layer_ids is [2, 4, 9] (layer outputs [1, 3, 8]), the target has num_hidden_layers 8"),
    ({"convention": SGLANG, "layer_ids": [1, 3, 9]},
     "eagle_config.eagle_aux_hidden_state_layer_ids is [1, 3, 9], the target has num_hidden_layers 8"),
    ({"convention": SGLANG, "layer_ids": [1, 3, 5]}, "reads the outputs of layers [1, 3, 5], this run extracted [1, 3, 4]"),
]


@pytest.mark.parametrize(("fields", "words"), MISMATCHES)
def test_a_base_that_does_not_fit_the_target_fails_by_name_before_training(make_run, tiny_model_dir, data_dir, fields, words):
    publish(data_dir, tiny_model_dir, **fields)
    paths = make_run("tuned", train={**ONE_STEP, "base_checkpoint": BASE})
    with pytest.raises(BaseCheckpointMismatch) as info:
        train(paths, tiny_model_dir)
    assert words in str(info.value)
    assert not paths.checkpoints_dir.exists() and not paths.train_log.exists()


def test_engine_fields_that_disagree_fail_by_name(make_run, tiny_model_dir, data_dir):
    base = publish(data_dir, tiny_model_dir, convention=BOTH)
    config = json.loads((base / "config.json").read_text())
    config["eagle_aux_hidden_state_layer_ids"] = [1, 3, 4]  # SGLang's ids copied: vLLM would read the layers below
    (base / "config.json").write_text(json.dumps(config))
    paths = make_run("tuned", train={**ONE_STEP, "base_checkpoint": BASE})
    with pytest.raises(CheckpointFormatError, match=r"eagle_aux_hidden_state_layer_ids is \[1, 3, 4\] and "
                                                    r"eagle_config.eagle_aux_hidden_state_layer_ids is \[1, 3, 4\]"):
        train(paths, tiny_model_dir)


def test_a_draftline_export_for_another_target_fails_naming_both_fingerprints(make_run, tiny_model_dir, tiny_target, data_dir):
    base = make_run("base", train=ONE_STEP)
    export_drafter(train(base, tiny_model_dir).drafter, data_dir / BASE, target_model="tiny", target_fingerprint="0" * 64)
    paths = make_run("tuned", train={**ONE_STEP, "base_checkpoint": BASE})
    with pytest.raises(BaseCheckpointMismatch) as info:
        train(paths, tiny_model_dir)
    assert f"draftline.target_fingerprint is {'0' * 64}, the target's fingerprint is {tiny_target.fingerprint}" in str(info.value)


def test_the_train_job_records_a_mismatch_by_name_in_the_runs_status(job_settings, make_run, tiny_model_dir, data_dir, redis_conn):
    publish(data_dir, tiny_model_dir, vocab_size=800)
    paths = make_run("tuned", train={**ONE_STEP, "base_checkpoint": BASE})
    with pytest.raises(BaseCheckpointMismatch):
        job_settings.train({"run": "tuned"})
    meta = RunState(redis_conn, data_dir, "tuned").meta()
    assert meta["train_state"] == "failed"
    assert meta["train_error"].startswith("BaseCheckpointMismatch: base checkpoint ")
    assert "vocab_size is 800, the target's vocab_size is 774" in meta["train_error"]
    assert not RunPaths(data_dir, "tuned").checkpoints_dir.exists() and not paths.export_dir.exists()


def test_the_train_job_result_says_where_the_draft_vocabulary_came_from(job_settings, make_run, tiny_model_dir, data_dir, redis_conn):
    publish(data_dir, tiny_model_dir, mapping=())
    make_run("tuned", train={**ONE_STEP, "base_checkpoint": BASE}, evaluate={"holdout": 0})
    result = job_settings.train({"run": "tuned"})
    assert result["draft_vocab"] == VOCAB_FROM_DATA and result["steps"] == 1
    assert RunState(redis_conn, data_dir, "tuned").meta()["train_draft_vocab"] == VOCAB_FROM_DATA
