"""The draft-vocabulary coverage benchmark: the vocabulary is the trainer's own pick from the training part, the
shares are counted on the held-out part, and each source splits its tokens the way the run does (the files as
train.validation_files holds them out, a dataset's rows as the evaluation holds them out)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoConfig, AutoTokenizer

from bench.bench_draft_vocab import coverage, main
from services.trainer.validation import validation_split
from shared import eagle3
from shared.layout import RunPaths
from shared.runspec import RunSpec, TrainConfig
from tests.services.controller.runs.test_datasets import write_jsonl


def test_the_vocabulary_comes_from_training_counts_and_shares_are_counted_on_the_held_out_part():
    train = torch.tensor([10, 5, 0, 1])
    held = {"h": torch.tensor([1, 1, 1, 1])}
    rows = coverage(train, held, [2, 4])
    # Size 2 keeps ids 0 and 1 (the most frequent in training): 15 of 16 training tokens, 2 of 4 held-out ones.
    assert rows[0] == {"size": 2, "train": 0.9375, "h": 0.5, "h_missed_per_1000": 500.0}
    assert rows[1] == {"size": 4, "train": 1.0, "h": 1.0, "h_missed_per_1000": 0.0}


def write_files_run(data, ids_per_sample: list[list[int]], masks: list[list[int]], validation_files: int) -> None:
    RunSpec(name="r", dataset="d", model="tiny", rows=len(ids_per_sample), train_ids=len(ids_per_sample),
            train=TrainConfig(validation_files=validation_files)).save(data)
    paths = RunPaths(data, "r")
    for sample_id, (ids, mask) in enumerate(zip(ids_per_sample, masks)):
        path = paths.hidden(sample_id)
        path.parent.mkdir(parents=True, exist_ok=True)
        save_file({eagle3.INPUT_IDS: torch.tensor(ids), eagle3.LOSS_MASK: torch.tensor(mask)}, str(path))


def test_files_count_only_learned_tokens_and_hold_out_the_validation_files(tmp_path, tiny_model_dir):
    ids = [[1, 2, 3, 4], [1, 5, 5, 6], [7, 7, 8, 9], [1, 10, 11, 12], [2, 2, 2, 13], [3, 14, 14, 14]]
    masks = [[0, 1, 1, 1]] * len(ids)  # the first token of each is prompt: never counted
    write_files_run(tmp_path, ids, masks, validation_files=2)
    out = tmp_path / "vocab.json"
    main(["--target", str(tiny_model_dir), "--data", str(tmp_path), "--run", "r", "--sizes", "3,1000",
          "--json", str(out)])
    facts = json.loads(out.read_text())
    trained, held = validation_split(list_of(tmp_path), 2)
    held_ids = {int(p.stem) for p in held}
    assert facts["train_files"] == 4 and facts["held_out_files"] == 2
    assert facts["train_tokens"] == 12 and facts["held_out_tokens"] == 6
    assert facts["target_vocab"] == AutoConfig.from_pretrained(tiny_model_dir).vocab_size
    counts = torch.zeros(facts["target_vocab"], dtype=torch.long)
    for sample_id, row in enumerate(ids):
        if sample_id not in held_ids:
            counts += torch.bincount(torch.tensor(row[1:]), minlength=facts["target_vocab"])
    assert facts["distinct_train_ids"] == int((counts > 0).sum())
    small, whole = facts["coverage"]
    assert small == coverage(counts, {"held_out": held_counts(ids, held_ids, facts["target_vocab"])}, [3])[0]
    assert whole["train"] == 1.0 and whole["size"] == facts["target_vocab"]  # capped at the target vocabulary


def list_of(data):
    from services.trainer.data import list_hidden_files

    return list_hidden_files(RunPaths(data, "r"))


def held_counts(ids, held_ids, vocab):
    counts = torch.zeros(vocab, dtype=torch.long)
    for sample_id in held_ids:
        counts += torch.bincount(torch.tensor(ids[sample_id][1:]), minlength=vocab)
    return counts


def test_a_run_without_validation_files_needs_them_named(tmp_path, tiny_model_dir):
    write_files_run(tmp_path, [[1, 2]] * 3, [[0, 1]] * 3, validation_files=0)
    with pytest.raises(SystemExit, match="--validation-files"):
        main(["--target", str(tiny_model_dir), "--data", str(tmp_path), "--run", "r", "--json", str(tmp_path / "v.json")])
    main(["--target", str(tiny_model_dir), "--data", str(tmp_path), "--run", "r", "--validation-files", "1",
          "--json", str(tmp_path / "v.json")])
    assert json.loads((tmp_path / "v.json").read_text())["held_out_files"] == 1


def test_a_dataset_holds_out_its_last_valid_rows_and_counts_their_first_and_second_replies_apart(tmp_path, tiny_model_dir):
    def chat(i: int) -> dict:
        return {"messages": [{"role": "assistant", "content": "a leading reply answers nothing"},
                             {"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"first reply {i}"},
                             {"role": "user", "content": "more"}, {"role": "assistant", "content": f"second one {i} ok"},
                             {"role": "user", "content": "and"}, {"role": "assistant", "content": "a third, past --turns"}]}

    rows = [chat(i) for i in range(8)]
    rows[6] = "{bad"  # not a valid row: the held-out rows are the last two valid ones, 5 and 7
    dataset = str(write_jsonl(tmp_path / "d.jsonl", rows))
    out = tmp_path / "vocab.json"
    main(["--target", str(tiny_model_dir), "--dataset", dataset, "--holdout", "2", "--sizes", "50", "--json", str(out)])
    facts = json.loads(out.read_text())
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)

    def tokens(text: str) -> int:
        return len(tokenizer.encode(text, add_special_tokens=False))

    assert facts["train_rows"] == 5 and facts["held_out_rows"] == 2 and facts["turns"] == 2
    assert facts["held_out_turn1_tokens"] == tokens("first reply 5") + tokens("first reply 7")
    # The conversation's last reply is the dataset's text too: counted, though the target would write it.
    assert facts["held_out_turn2_tokens"] == tokens("second one 5 ok") + tokens("second one 7 ok")
    assert facts["train_tokens"] == sum(tokens(f"first reply {i}") + tokens(f"second one {i} ok") for i in range(5))
    assert set(facts["coverage"][0]) == {"size", "train", "held_out_turn1", "held_out_turn1_missed_per_1000",
                                         "held_out_turn2", "held_out_turn2_missed_per_1000"}
    main(["--target", str(tiny_model_dir), "--dataset", dataset, "--holdout", "2", "--turns", "1", "--json", str(out)])
    facts = json.loads(out.read_text())
    assert facts["held_out_turn2_tokens"] == 0
    assert facts["train_tokens"] == sum(tokens(f"first reply {i}") for i in range(5))
