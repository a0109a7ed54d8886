"""Held-out validation while training: which files are held out, where their turns lie, that the curve from
the stored states is the one-pass curve the target's own forward gives over the same turns, and that a run
with ``train.validation_files`` trains on the rest and logs the curve at every checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from services.trainer.data import Batch, HiddenStateDataset, collate, list_hidden_files
from evaluation.one_pass import Replay, Span, one_pass_counts
from services.trainer.validation import Validation, turn_spans, validation_split
from shared.errors import HiddenStateFileError
from shared.runspec import RunSpec
from tests.support.tiny_runs import DFLASH_TRAIN


def files_of(count: int) -> list[tuple[int, Path]]:
    return [(i, Path(f"{i:08d}.safetensors")) for i in range(count)]


def test_the_held_out_files_are_a_fixed_spread_choice_and_the_rest_train():
    train, held = validation_split(files_of(100), 10)
    assert len(held) == 10 and len(train) == 90 and not set(train) & set(held)
    assert train == sorted(train) and held == sorted(held)
    assert validation_split(files_of(100), 10) == (train, held)  # the same on every rank and resume
    assert max(held).name > "00000050" and min(held).name < "00000050"  # not simply the first or last rows
    assert validation_split(files_of(5), 0) == ([p for _, p in files_of(5)], [])
    with pytest.raises(HiddenStateFileError, match="leaves none of the run's 5"):
        validation_split(files_of(5), 5)


def test_every_run_of_loss_masked_tokens_is_a_turn():
    ids = torch.arange(100, 112)[None].repeat(2, 1)
    mask = torch.tensor([[0, 0, 1, 1, 1, 0, 0, 1, 1, 0, 0, 0],
                         [1, 1, 1, 0, 0, 0, 0, 0, 1, 1, 0, 0]], dtype=torch.bool)
    lengths = torch.tensor([12, 10])  # the second row's padding holds no turn
    batch = Batch(ids, mask, torch.zeros(2, 12, 3), torch.zeros(2, 12, 1), lengths)
    assert turn_spans(batch) == [Span(0, 2, [102, 103, 104]), Span(0, 7, [107, 108]),
                                 Span(1, 1, [101, 102]),  # a turn at index 0 has no prompt: it starts a token later
                                 Span(1, 8, [108, 109])]


def test_the_stored_states_give_the_curve_the_targets_own_forward_gives(make_run, trained_drafter, tiny_target):
    paths = make_run()
    files = [path for _, path in list_hidden_files(paths)][:6]
    ks = [1, 2, 3, 4]
    measured = Validation(files, 4096, ks, torch.device("cpu")).measure(trained_drafter)
    samples = collate([HiddenStateDataset(files, 4096)[i] for i in range(len(files))])
    spans = turn_spans(samples)
    ids = samples.input_ids.tolist()
    replays = [Replay(ids[s.row][: s.start], s.reply) for s in spans]
    from_target = one_pass_counts(tiny_target.model, replays, {"d": trained_drafter}, ks, batch_tokens=1 << 16)["d"]
    assert measured["files"] == 6 and measured["turns"] == len(spans) >= 6
    assert measured["tokens"] == from_target.emitted[1] == sum(len(s.reply) - 1 for s in spans)
    for k in ks:  # the files' states and a batched forward round apart: a turned near tie moves a turn by a pass
        passes = round(measured["tokens"] / measured["curve"][str(k)])
        assert abs(passes - from_target.passes[k]) <= len(spans), k
    assert measured["curve"]["4"] > 1.2  # the drafter learned these conversations: the walk accepted drafts
    assert trained_drafter.training is False


@pytest.mark.parametrize("method", ["eagle3", pytest.param("dflash", marks=pytest.mark.dflash)])
def test_a_run_with_held_out_files_trains_on_the_rest_and_logs_the_curve_at_every_checkpoint(method, make_run,
                                                                                             tiny_target):
    from services.trainer.train import train_drafter

    train = {"validation_files": 4, "save_every": 4, **(DFLASH_TRAIN if method == "dflash" else {})}
    paths = make_run(train=train, evaluate={"curve_max_steps": 3, "draft_steps": 2})
    seen = []
    result = train_drafter(RunSpec.load(paths.data, paths.run), data=paths.data, model_dir=tiny_target.model_dir,
                           device="cpu", progress=seen.append)
    assert result.num_files == 12  # 16 files, 4 held out
    lines = [json.loads(line) for line in paths.validation_log.read_text().splitlines()]
    assert [line["step"] for line in lines] == [4, result.steps]  # 3 steps an epoch, 2 epochs: checkpoints at 4 and 6
    for line in lines:
        assert line["files"] == 4 and line["turns"] >= 4 and set(line["curve"]) == {"1", "2", "3"}
        assert all(value >= 1.0 for value in line["curve"].values())
    assert [p.validation is None for p in seen] == [True] * 3 + [False] * 3  # from the first checkpoint on
    assert seen[-1].validation == lines[-1]["curve"]


def test_a_checkpoint_whose_measurement_fails_is_logged_with_its_error_and_training_goes_on(make_run, tiny_target,
                                                                                            monkeypatch, caplog):
    from services.trainer.train import train_drafter

    real, calls = Validation.measure, []

    def fails_first(self, drafter):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("CUDA out of memory (stand-in)")
        return real(self, drafter)

    monkeypatch.setattr(Validation, "measure", fails_first)
    paths = make_run(train={"validation_files": 4, "save_every": 4}, evaluate={"curve_max_steps": 3, "draft_steps": 2})
    seen = []
    result = train_drafter(RunSpec.load(paths.data, paths.run), data=paths.data, model_dir=tiny_target.model_dir,
                           device="cpu", progress=seen.append)
    lines = [json.loads(line) for line in paths.validation_log.read_text().splitlines()]
    assert lines[0] == {"step": 4, "epoch": 1, "error": "RuntimeError: CUDA out of memory (stand-in)"}
    assert lines[1]["step"] == result.steps == 6 and set(lines[1]["curve"]) == {"1", "2", "3"}
    # No figure while the latest checkpoint has none: the status never shows an earlier one as current.
    assert [p.validation is None for p in seen] == [True] * 5 + [False]
    assert "held-out acceptance not measured" in caplog.text
    assert paths.train_log.read_text().count("\n") == 6  # every step trained
