"""The training options of issue 47 on the tiny target, through the real trainer: an LK loss (``train.loss``)
and EAGLE-3.1's normalized auxiliary states (``train.aux_norm``) each train a drafter whose export the
engines' layout reads back to the drafter that trained; and the normalized drafter's training logits are
what the evaluation's proposer, which feeds what vLLM's EAGLE-3 proposer feeds, computes after the same
verified prefix."""

from __future__ import annotations

import json
import math

import pytest
import torch

from modeling.eagle3 import DrafterConfig, Eagle3Drafter, ttt_unroll
from modeling.export import export_drafter, load_drafter, verify_export
from modeling.losses import StepLoss
from modeling.target_head import load_target_head, read_target_config
from services.trainer.session import prepare, trained_from_checkpoint
from services.trainer.train import train_drafter
from shared.runspec import RunSpec
from tests.services.trainer.test_alignment import STEPS, chain_against_training, target_states
from tests.support.tiny_runs import DFLASH_TRAIN, LAYER_IDS, prompt_ids


def train(paths, model_dir):
    return train_drafter(RunSpec.load(paths.data, paths.run), data=paths.data, model_dir=model_dir, device="cpu")


def log_records(paths) -> list[dict]:
    return [json.loads(line) for line in paths.train_log.read_text().splitlines()]


def mean(rows: list[dict], key) -> float:
    return sum(key(r) for r in rows) / len(rows)


def exported_and_reloaded(drafter, tmp_path, tiny_target):
    export = export_drafter(drafter, tmp_path / "export", target_model="tiny", target_fingerprint=tiny_target.fingerprint,
                            dtype=torch.float32)
    return verify_export(export), load_drafter(export, tiny_target.model_dir)


@torch.no_grad()
def assert_same_chain_logits(trained: Eagle3Drafter, served: Eagle3Drafter, tiny_target) -> None:
    """The reloaded export computes what the trained drafter computes, chain step for chain step."""
    ids = torch.tensor(prompt_ids(tiny_target, [{"role": "user", "content": "Name a colour."}]))
    aux = target_states(tiny_target, ids)[0][None]
    for mine, theirs in zip(ttt_unroll(trained.eval(), ids[None], aux, STEPS), ttt_unroll(served, ids[None], aux, STEPS)):
        torch.testing.assert_close(served.logits(theirs), trained.logits(mine), rtol=0, atol=0)


@pytest.mark.parametrize(("settings", "loss", "aux_norm"), [
    ({}, StepLoss("kl"), False),
    ({"loss": "lk_lambda", "lk_eta": 2.0}, StepLoss("lk_lambda", 2.0), False),
    ({"loss": "lk_alpha", "aux_norm": True}, StepLoss("lk_alpha"), True),
])
def test_the_session_trains_with_the_loss_and_the_drafter_the_run_asks_for(make_run, tiny_model_dir, settings, loss, aux_norm):
    paths = make_run(train=settings)
    session = prepare(RunSpec.load(paths.data, paths.run), data=paths.data, model_dir=tiny_model_dir, device="cpu")
    assert session.objective.loss == loss and session.drafter.config.aux_norm is aux_norm
    assert hasattr(session.drafter, "fc_norm") is aux_norm


@pytest.mark.parametrize("settings", [{"loss": "lk_lambda"}, {"loss": "lk_alpha"}, {"aux_norm": True},
                                      {"loss": "lk_lambda", "aux_norm": True}], ids=lambda s: "+".join(f"{k}={v}" for k, v in s.items()))
def test_each_option_trains_a_drafter_whose_export_computes_what_it_learned(make_run, tiny_model_dir, tiny_target,
                                                                            tmp_path, settings):
    paths = make_run(train={**settings, "epochs": 12, "save_every": 1000})
    result = train(paths, tiny_model_dir)
    records = log_records(paths)
    assert result.steps == len(records) == 48 and all(math.isfinite(r["loss"]) for r in records)
    assert mean(records[-8:], lambda r: r["loss"]) < mean(records[:4], lambda r: r["loss"])
    assert mean(records[-8:], lambda r: r["acc"][0]) > mean(records[:4], lambda r: r["acc"][0]) + 0.5
    config, served = exported_and_reloaded(result.drafter, tmp_path, tiny_target)
    assert config["fc_norm"] is settings.get("aux_norm", False)  # a loss never changes what the engine serves
    assert served.config == result.drafter.config
    assert_same_chain_logits(result.drafter, served, tiny_target)
    # A multi-process run's job exports from the last checkpoint: the norms come back from it too.
    rebuilt = trained_from_checkpoint(RunSpec.load(paths.data, paths.run), data=paths.data, model_dir=tiny_model_dir).drafter
    assert rebuilt.config == result.drafter.config
    assert all(torch.equal(rebuilt.export_state()[name], t) for name, t in result.drafter.export_state().items())


def test_a_dflash_drafter_trains_with_an_lk_loss(make_run, tiny_model_dir):
    paths = make_run(train={**DFLASH_TRAIN, "loss": "lk_alpha", "epochs": 12, "save_every": 1000})
    assert train(paths, tiny_model_dir).steps == 48
    records = log_records(paths)
    assert all(math.isfinite(r["loss"]) for r in records)
    assert mean(records[-8:], lambda r: r["loss"]) < mean(records[:4], lambda r: r["loss"])
    assert mean(records[-8:], lambda r: r["acc"][0]) > mean(records[:4], lambda r: r["acc"][0]) + 0.4


@torch.no_grad()
def test_normalized_training_logits_equal_the_proposers_chain_after_the_same_verified_prefix(tiny_target):
    """As tests/services/trainer/test_alignment.py, for a drafter with normalized auxiliary states: the proposer
    normalizes the target's states as training does, so step k's logits at index P-1 are chain step k's."""
    torch.manual_seed(3)
    config = DrafterConfig.from_target_config(read_target_config(tiny_target.model_dir), draft_vocab_size=10**9,
                                              layer_ids=LAYER_IDS, aux_norm=True)
    drafter = Eagle3Drafter(config)
    drafter.load_embedding(load_target_head(tiny_target.model_dir).embed)
    drafter.set_vocab_mapping(torch.zeros(config.vocab_size, dtype=torch.long), torch.ones(config.vocab_size, dtype=torch.bool))
    for norm in drafter.fc_norm:
        norm.weight.uniform_(0.5, 1.5)
    drafter.eval()
    prompt, _, seen, unrolled = chain_against_training(tiny_target, drafter)
    p = len(prompt)
    for k in range(STEPS):
        torch.testing.assert_close(drafter.logits(unrolled[k])[0, p - 1], seen[k], rtol=1e-4, atol=1e-5)
