"""The DFlash drafter and its block objective (modeling/dflash.py) on the tiny target's own data:
which positions a block sees, which anchors it trains on, that it learns, and that it resumes exactly."""

from __future__ import annotations

import json
import math

import pytest
import torch

from modeling.dflash import DFlashConfig, DFlashDrafter, sample_anchors, slot_weights
from modeling.eagle3 import DrafterConfig
from services.trainer.train import TrainProgress, train_drafter
from shared.runspec import RunSpec

pytestmark = pytest.mark.dflash

DFLASH = {"method": "dflash", "dflash": {"block_size": 4, "layers": 2, "anchors": 16}}
BASE = DrafterConfig(hidden_size=32, target_hidden_size=24, intermediate_size=48, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=8, vocab_size=50, draft_vocab_size=50, layer_ids=(0, 1, 2))


def random_drafter(block_size: int = 4, causal: bool = False, seed: int = 0) -> DFlashDrafter:
    torch.manual_seed(seed)
    drafter = DFlashDrafter(DFlashConfig(BASE, num_layers=2, block_size=block_size, mask_token_id=49, causal=causal))
    drafter.load_embedding(torch.randn(50, 32))
    drafter.set_vocab_mapping(torch.zeros(50, dtype=torch.long), torch.ones(50, dtype=torch.bool))
    with torch.no_grad():
        for param in drafter.trainable_parameters():
            param.add_(torch.randn_like(param) * 0.1)  # norms away from 1, so a shared weight is visible
    return drafter.eval()


def block_at(drafter: DFlashDrafter, ids: torch.Tensor, aux: torch.Tensor, anchors: list[int]) -> torch.Tensor:
    """The training pass's final hidden states of the blocks at ``anchors`` of one sequence: (A, S, H)."""
    length = ids.shape[0]
    positions = torch.arange(length)
    context = drafter.context(aux[None], positions[None])
    starts = torch.tensor([anchors])
    sees = positions[None, None, :] < starts[:, :, None]
    return drafter.draft(ids[None].gather(1, starts), starts, drafter.config.block_size, context, sees)[0]


def train(paths, model_dir, **kwargs):
    return train_drafter(RunSpec.load(paths.data, paths.run), data=paths.data, model_dir=model_dir, device="cpu", **kwargs)


def log_records(paths) -> list[dict]:
    return [json.loads(line) for line in paths.train_log.read_text().splitlines()]


# ---- what a block sees ---------------------------------------------------------------------------

def test_a_block_sees_the_context_strictly_before_its_anchor_and_nothing_of_other_blocks():
    drafter = random_drafter()
    torch.manual_seed(1)
    ids, aux = torch.randint(0, 49, (20,)), torch.randn(20, 72)
    out = block_at(drafter, ids, aux, [5, 12])
    later = aux.clone()
    later[12:] = torch.randn(8, 72)  # the anchor's own state and everything after it
    other_tokens = ids.clone()
    other_tokens[13:] = (other_tokens[13:] + 1) % 49  # tokens the block at 12 has not been given
    assert torch.allclose(block_at(drafter, ids, later, [5, 12]), out, atol=1e-6)
    assert torch.allclose(block_at(drafter, other_tokens, aux, [5, 12]), out, atol=1e-6)
    earlier = aux.clone()
    earlier[11] += 1.0  # the last context position of the block at 12, after the block at 5
    changed = block_at(drafter, ids, earlier, [5, 12])
    assert torch.allclose(changed[0], out[0], atol=1e-6) and not torch.allclose(changed[1], out[1], atol=1e-3)
    alone = block_at(drafter, ids, aux, [12])  # the other block takes no part in this one
    assert torch.allclose(alone[0], out[1], atol=1e-5)


@pytest.mark.parametrize("causal", [False, True])
def test_mask_slots_see_their_whole_block_or_only_its_earlier_slots(causal):
    drafter = random_drafter(causal=causal)
    torch.manual_seed(2)
    ids, aux = torch.randint(0, 49, (16,)), torch.randn(16, 72)
    out = block_at(drafter, ids, aux, [8])[0]  # (S, H)
    other = DFlashDrafter(DFlashConfig(BASE, num_layers=2, block_size=4, mask_token_id=48, causal=causal))
    other.load_state_dict(drafter.state_dict())
    moved = block_at(other.eval(), ids, aux, [8])[0]  # every mask slot's input changes; the anchor's does not
    assert torch.allclose(moved[0], out[0], atol=1e-6) is causal  # the anchor sees the slots only bidirectionally


def test_one_k_norm_weight_serves_every_layer_and_the_export_writes_it_into_each():
    drafter = random_drafter()
    names = [name for name, _ in drafter.named_parameters()]
    assert "k_norm.weight" in names and not any(".k_norm." in name for name in names)
    state = drafter.export_state()
    for i in range(2):
        assert torch.equal(state[f"layers.{i}.self_attn.k_norm.weight"], drafter.k_norm.weight)
    assert not any(name.startswith(("embed_tokens", "k_norm")) for name in state)


def test_anchors_are_distinct_loss_masked_positions_with_a_successor_and_repeat_with_their_seed():
    loss_mask = torch.zeros(2, 12, dtype=torch.bool)
    loss_mask[0, 3:12] = True  # the last one has no successor stored
    loss_mask[1, 5:7] = True
    lengths = torch.tensor([12, 9])
    anchors, used = sample_anchors(loss_mask, lengths, 4, seeds=[7, 8])
    assert used[0].all() and used[1].tolist() == [True, True, False, False]
    assert set(anchors[1, :2].tolist()) == {5, 6}
    first = anchors[0].tolist()
    assert len(set(first)) == 4 and all(3 <= a <= 10 for a in first) and first == sorted(first)
    again, _ = sample_anchors(loss_mask, lengths, 4, seeds=[7, 8])
    assert torch.equal(again, anchors)
    alone, _ = sample_anchors(loss_mask[:1], lengths[:1], 4, seeds=[7])  # a row's draw is its own
    assert torch.equal(alone[0], anchors[0])
    draws = {tuple(sample_anchors(loss_mask, lengths, 4, seeds=[s, 0])[0][0].tolist()) for s in range(8)}
    assert len(draws) > 1


def test_slot_weights_decay_from_one():
    weights = slot_weights(8, 4.0)
    assert weights.shape == (7,) and weights[0] == 1.0
    assert torch.allclose(weights[1:] / weights[:-1], torch.full((6,), math.exp(-0.25), dtype=torch.float64))


# ---- training ------------------------------------------------------------------------------------

def test_dflash_training_learns_the_targets_replies(make_run, tiny_model_dir):
    paths = make_run(train={**DFLASH, "epochs": 30, "save_every": 1000})
    result = train(paths, tiny_model_dir)
    records = log_records(paths)
    assert isinstance(result.drafter, DFlashDrafter) and result.steps == len(records) == 120
    assert all(len(r["acc"]) == len(r["loss_k"]) == 3 for r in records)  # one figure per mask slot
    mean = lambda rows, key: sum(key(r) for r in rows) / len(rows)  # noqa: E731
    first, last = records[:5], records[-10:]
    assert mean(last, lambda r: r["loss"]) < mean(first, lambda r: r["loss"]) - 1.0
    assert mean(last, lambda r: r["acc"][0]) > mean(first, lambda r: r["acc"][0]) + 0.15


def test_dflash_trains_on_fp8_files_as_on_the_target_dtype_files(make_run, tiny_model_dir):
    mean = lambda rows, key: sum(r[key] if key == "loss" else r[key][0] for r in rows) / len(rows)  # noqa: E731
    curves = {}
    for storage in ("target", "fp8"):
        paths = make_run(storage, storage=storage, train={**DFLASH, "epochs": 30, "save_every": 1000})
        assert train(paths, tiny_model_dir).steps == 120
        curves[storage] = log_records(paths)
    exact, fp8 = curves["target"], curves["fp8"]
    assert fp8[0]["loss"] != exact[0]["loss"]  # the drafter really saw other inputs
    assert abs(mean(fp8[-10:], "loss") - mean(exact[-10:], "loss")) < 0.05 * mean(exact[-10:], "loss")
    assert abs(mean(fp8[-10:], "acc") - mean(exact[-10:], "acc")) < 0.05


class Crash(Exception):
    pass


def test_an_interrupted_dflash_run_resumes_to_the_same_weights(make_run, tiny_model_dir):
    straight = make_run("straight", train={**DFLASH, "epochs": 3, "save_every": 2})
    reference = train(straight, tiny_model_dir)
    paths = make_run("crashed", train={**DFLASH, "epochs": 3, "save_every": 2})

    def crash(progress: TrainProgress) -> None:
        if progress.step == 5:
            raise Crash

    with pytest.raises(Crash):
        train(paths, tiny_model_dir, progress=crash)
    resumed = train(paths, tiny_model_dir)
    a, b = reference.drafter.checkpoint_state(), resumed.drafter.checkpoint_state()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert [r["loss"] for r in log_records(paths)] == [r["loss"] for r in log_records(straight)]
