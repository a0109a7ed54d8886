"""An online run's plan (services/trainer/online_plan.py): which samples it trains and holds out, each one's
length and learned tokens read from its reply record before any state exists, the replies that make no sample,
and the epochs planned from those lengths as offline."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from services.trainer.batching import LENGTH, plan_padding
from services.trainer.online_plan import OnlinePlanError, ReplyTokens, load_plan, make_plan, read_plan
from services.trainer.sources import epoch_plan
from services.trainer.vocab import TokenTally
from shared.atomic import atomic_write_json
from shared.errors import PromptTooLong
from shared.layout import RunPaths
from shared.lifecycle import Stage
from shared.runspec import ExtractionConfig, OnlineConfig, RunSpec, TrainConfig

RUN = "plan"
VOCAB = 64


def spec_of(rows: int, max_length: int = 4096, **train) -> RunSpec:
    return RunSpec(name=RUN, dataset="d.jsonl", model="m", rows=rows, train_ids=rows, train=TrainConfig(**train),
                   extraction=ExtractionConfig(max_length=max_length), online=OnlineConfig(enabled=True, budget_bytes=10**6))


def reply(sample_id: int) -> tuple[list[int], list[int]]:
    """The engine's (prompt ids, reply ids) of a sample: lengths that differ from one sample to the next."""
    return [1 + sample_id % 7] * (3 + sample_id % 5), [10 + sample_id % 11] * (2 + 3 * sample_id % 17)


def with_replies(data, ids, failed=(), long_prompt=()) -> RunPaths:
    paths = RunPaths(data, RUN)
    for i in ids:
        prompt, answer = reply(i)
        if i in long_prompt:
            prompt = [1] * 5000
        atomic_write_json(paths.generated(i), {"sample_id": i, "messages": [{"role": "user", "content": "q"}],
                                               "reply": {"content": "a"}, "finish_reason": "stop",
                                               "token_ids": {"prompt": prompt, "reply": answer}})
    for i in failed:
        atomic_write_json(paths.failure(Stage.EXTRACT, i), {"sample_id": i})
    return paths


def reader(paths: RunPaths, spec: RunSpec) -> ReplyTokens:
    return ReplyTokens(paths, spec, model_dir=paths.data / "no-model")  # engine ids: no tokenizer is loaded


def test_the_plan_is_the_samples_with_a_reply_less_the_held_out_with_their_lengths_and_is_kept(data_dir):
    paths = with_replies(data_dir, [i for i in range(20) if i not in (3, 7)], failed=[11])
    spec = spec_of(20, validation_files=2)
    tally = TokenTally(VOCAB)
    plan, failures = make_plan(paths, spec, reader(paths, spec), tally)
    assert len(plan.validation_ids) == 2 and not set(plan.validation_ids) & set(plan.train_ids) and failures == []
    assert sorted(plan.train_ids + plan.validation_ids) == [i for i in range(20) if i not in (3, 7, 11)]
    assert plan.tokens == [sum(map(len, reply(i))) for i in plan.train_ids]  # what extraction's files will hold
    expected = torch.zeros(VOCAB, dtype=torch.long)  # every training sample's reply tokens, as offline counts files
    for i in plan.train_ids:
        for token in reply(i)[1]:
            expected[token] += 1
    assert torch.equal(tally.counts, expected) and tally.files == len(plan.train_ids)

    kept, kept_tally = load_plan(paths, spec, 0, reader(paths, spec), vocab_size=VOCAB)  # written on the first start
    assert kept == plan and torch.equal(kept_tally.counts, expected)
    with_replies(data_dir, [3])  # a reply that lands later changes nothing: the plan is what training started with
    again, again_tally = load_plan(paths, spec, 1, reader(paths, spec), vocab_size=VOCAB)
    assert again == kept == read_plan(paths) and torch.equal(again_tally.counts, expected)


def test_a_reply_that_makes_no_sample_is_named_as_extraction_would_name_it_and_trains_in_no_epoch(data_dir):
    paths = with_replies(data_dir, range(8), long_prompt=[5])
    spec = spec_of(8, max_length=4096)
    named = []
    plan, _ = load_plan(paths, spec, 0, reader(paths, spec), vocab_size=VOCAB, on_failure=named.append)
    assert [f.sample_id for f in named] == [5] and isinstance(named[0].error, PromptTooLong)
    assert 5 not in plan.train_ids and len(plan.train_ids) == 7


def test_a_run_without_replies_has_no_plan(data_dir):
    spec = spec_of(5)
    paths = RunPaths(data_dir, RUN)
    with pytest.raises(OnlinePlanError, match="no sample has a reply"):
        make_plan(paths, spec, reader(paths, spec), TokenTally(VOCAB))


def test_a_plan_an_earlier_version_wrote_without_lengths_gets_them_for_the_same_samples(data_dir):
    paths = with_replies(data_dir, range(10))
    spec = spec_of(10)
    atomic_write_json(paths.online_plan, {"train_ids": [0, 2, 4, 6, 8, 9], "validation_ids": [1],
                                          "facts": {"epochs": 2}})
    plan, tally = load_plan(paths, spec, 0, reader(paths, spec), vocab_size=VOCAB)
    assert plan.train_ids == [0, 2, 4, 6, 8, 9] and plan.tokens == [sum(map(len, reply(i))) for i in plan.train_ids]
    assert tally.files == 6 and read_plan(paths) == plan
    assert RunPaths(data_dir, RUN).online_plan.read_text().count('"epochs": 2')  # its facts kept


@pytest.mark.parametrize("world", [1, 2, 4])
def test_online_epochs_are_planned_by_length_like_offline_and_alike_on_any_number_of_processes(world):
    lengths = [17 + (i * 37) % 300 for i in range(200)]
    cfg = TrainConfig(global_batch_size=8, seed=7)
    epochs = [epoch_plan(cfg, lengths, epoch, world, LENGTH) for epoch in range(3)]
    assert epochs == [epoch_plan(cfg, lengths, epoch, 1, LENGTH) for epoch in range(3)]  # any number of processes
    for batches in epochs:
        assert Counter(i for batch in batches for i in batch) == Counter(range(200))  # each sample once per epoch
    assert epochs[0] != epochs[1]  # another order each epoch
    shuffled = epoch_plan(cfg, lengths, 0, 1, "shuffle")
    assert plan_padding(epochs[0], lengths, 1).fraction < plan_padding(shuffled, lengths, 1).fraction / 2
    by_tokens = epoch_plan(TrainConfig(max_tokens=600, seed=7), lengths, 0, 1, LENGTH)  # train.max_tokens online
    assert all(len(b) * max(lengths[i] for i in b) <= 600 or len(b) == 1 for b in by_tokens)


@pytest.mark.parametrize("world,global_batch", [(1, None), (2, None), (2, 8)])
def test_a_batch_token_cap_cuts_only_the_batches_that_reach_it(world, global_batch):
    lengths = [17 + (i * 37) % 300 for i in range(200)]
    cfg = TrainConfig(batch_size=4, global_batch_size=global_batch, seed=3)
    plain = epoch_plan(cfg, lengths, 0, world, LENGTH)
    padded = [len(b) * max(lengths[i] for i in b) for b in plain]
    assert epoch_plan(cfg, lengths, 0, world, LENGTH, cap_tokens=max(padded) * 2) == plain  # a cap no batch reaches
    cap = sorted(padded)[len(padded) // 2]  # half the batches reach it
    capped = epoch_plan(cfg, lengths, 0, world, LENGTH, cap_tokens=cap)
    assert Counter(i for batch in capped for i in batch) == Counter(range(200))  # still each sample once
    span, ranks = (global_batch, 1) if global_batch else (4 * world, world)  # a global batch is cut as one process's
    for b in capped:  # each process's padded share within its part of the cap, unless one sample a process is over it
        assert len(b) <= span and (len(b) <= ranks or -(-len(b) // ranks) * max(lengths[i] for i in b) <= cap // ranks)
    assert len(capped) > len(plain)
