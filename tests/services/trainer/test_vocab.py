"""Draft vocabulary: most frequent loss-masked target tokens, d2t offsets and t2d flags."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from services.trainer.vocab import build_mapping, count_tokens, draft_to_target
from shared.drafter_format import check_mapping
from shared import eagle3


def test_mapping_keeps_the_most_frequent_ids_in_id_order_with_offsets():
    #                      id: 0  1  2  3  4  5  6  7
    counts = torch.tensor([5, 0, 9, 1, 9, 0, 7, 2])
    d2t, t2d = build_mapping(counts, draft_vocab_size=4)
    # Top four by count: 2 (9), 4 (9), 6 (7), 0 (5); draft ids follow ascending target ids 0, 2, 4, 6.
    assert d2t.tolist() == [0, 1, 2, 3]  # target = draft + d2t: 0+0, 1+1, 2+2, 3+3
    assert draft_to_target(d2t).tolist() == [0, 2, 4, 6]
    assert t2d.tolist() == [True, False, True, False, True, False, True, False]
    assert d2t.dtype == torch.int64 and t2d.dtype == torch.bool


def test_ties_go_to_the_lower_id_and_unseen_ids_fill_the_rest():
    counts = torch.tensor([0, 3, 3, 0, 3, 0])
    d2t, t2d = build_mapping(counts, draft_vocab_size=2)
    assert draft_to_target(d2t).tolist() == [1, 2]
    d2t, t2d = build_mapping(counts, draft_vocab_size=5)
    assert draft_to_target(d2t).tolist() == [0, 1, 2, 3, 4]  # 1, 2, 4 by count, then 0 and 3 by id


def test_draft_vocabulary_is_capped_at_the_target_vocabulary():
    d2t, t2d = build_mapping(torch.tensor([1, 2, 3]), draft_vocab_size=32000)
    assert d2t.tolist() == [0, 0, 0] and t2d.all()


def test_counts_only_loss_masked_positions(tmp_path):
    path = tmp_path / "00000000.safetensors"
    save_file({
        eagle3.INPUT_IDS: torch.tensor([7, 7, 3, 3, 3, 1]),
        eagle3.LOSS_MASK: torch.tensor([0, 0, 1, 1, 0, 1], dtype=torch.uint8),
        eagle3.AUX_HIDDEN: torch.zeros(6, 6),
        eagle3.LAST_HIDDEN: torch.zeros(6, 2),
    }, str(path))
    counts = count_tokens([path, path], vocab_size=8)
    assert counts.tolist() == [0, 2, 0, 4, 0, 0, 0, 0]  # token 7 appears only in the prompt


def test_check_mapping_rejects_inconsistent_buffers():
    d2t, t2d = (t.numpy() for t in build_mapping(torch.tensor([4, 3, 2, 1]), draft_vocab_size=2))
    check_mapping(d2t, t2d)
    broken = t2d.copy()
    broken[3] = True
    with pytest.raises(ValueError, match="t2d"):
        check_mapping(d2t, broken)
    with pytest.raises(ValueError, match="outside"):
        check_mapping(np.array([0, 10]), t2d)
    with pytest.raises(ValueError, match="same target id"):
        check_mapping(np.array([1, 0]), t2d)


def test_the_mask_token_is_the_highest_id_no_file_holds_and_its_absence_is_named(tmp_path):
    from services.trainer.vocab import unused_token
    from shared.errors import MaskTokenUnavailable

    files = []
    for i, ids in enumerate(([0, 1, 2, 5], [3, 7, 1])):
        path = tmp_path / f"{i}.safetensors"
        save_file({eagle3.INPUT_IDS: torch.tensor(ids), eagle3.LOSS_MASK: torch.zeros(len(ids), dtype=torch.bool)}, str(path))
        files.append(path)
    assert unused_token(files, vocab_size=8) == 6  # 7 is a prompt token of the second file (mask 0 counts too)
    assert unused_token(files, vocab_size=8, max_length=1) == 7  # only the rows training reads
    with pytest.raises(MaskTokenUnavailable, match="mask_token_id"):
        unused_token(files, vocab_size=4)
