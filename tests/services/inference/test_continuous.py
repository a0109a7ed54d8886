"""The continuous-batching decoder against Hugging Face ``generate`` (fp32 CPU): every request's tokens are
what it produces alone, however requests join and leave the slots."""

from __future__ import annotations

import dataclasses
import threading

import pytest

from services.inference.continuous import ContinuousScheduler
from services.inference.decode import GenerationRequest, generate_batch
from services.inference.sampling import SamplingParams
from services.inference.slots import SlotModel
from tests.services.inference.test_decode import MAX_NEW, PROMPTS, chat_prompt_ids, hf_greedy

MORE = ["Tell me about caches.", "What is a slot?", "Why batch requests at all, when one at a time is simpler?"]


@pytest.fixture(scope="module")
def prompt_ids(loaded_tiny) -> list[list[int]]:
    return chat_prompt_ids(loaded_tiny, PROMPTS + MORE)


def run(loaded, requests, *, slots: int, slot_tokens: int = 256, prefill_tokens: int = 4096, long: SlotModel | None = None):
    scheduler = ContinuousScheduler(SlotModel(loaded, slots=slots, slot_tokens=slot_tokens),
                                    prefill_tokens=prefill_tokens, long=long).start()
    try:
        futures = [scheduler.submit(r) for r in requests]
        return [f.result(timeout=120) for f in futures]
    finally:
        scheduler.stop()


def test_greedy_requests_equal_hf_generate_as_they_join_freed_slots(loaded_tiny, prompt_ids):
    budgets = MAX_NEW + [11, 40, 6]
    requests = [GenerationRequest(ids, n) for ids, n in zip(prompt_ids, budgets)]
    # Three slots for seven requests: most join while others decode, into slots freed at other positions.
    results = run(loaded_tiny, requests, slots=3)
    for ids, n, result in zip(prompt_ids, budgets, results):
        assert result.token_ids == hf_greedy(loaded_tiny, ids, n)
        assert result.finish_reason == ("stop" if result.token_ids[-1] in loaded_tiny.eos_token_ids else "length")


def test_a_small_prefill_budget_admits_one_request_at_a_time_with_the_same_tokens(loaded_tiny, prompt_ids):
    requests = [GenerationRequest(ids, 9) for ids in prompt_ids[:4]]
    expected = [hf_greedy(loaded_tiny, ids, 9) for ids in prompt_ids[:4]]
    assert [r.token_ids for r in run(loaded_tiny, requests, slots=4, prefill_tokens=1)] == expected


def test_a_row_stops_at_eos_and_its_slot_serves_the_next_request(loaded_tiny, prompt_ids):
    free_run = hf_greedy(loaded_tiny, prompt_ids[1], 17)
    eos = free_run[5]
    loaded = dataclasses.replace(loaded_tiny, eos_token_ids=frozenset({eos}))
    requests = [GenerationRequest(ids, n) for ids, n in zip(prompt_ids, MAX_NEW)]
    results = run(loaded, requests, slots=2)
    assert results[1].token_ids == free_run[: free_run.index(eos) + 1] and results[1].finish_reason == "stop"
    assert [(r.token_ids, r.finish_reason) for r in results] == \
        [(r.token_ids, r.finish_reason) for r in generate_batch(loaded, requests)]


def test_seeded_sampling_matches_the_per_batch_decoder(loaded_tiny, prompt_ids):
    requests = [GenerationRequest(ids, 12, SamplingParams(temperature=5.0, top_p=0.9, seed=i))
                for i, ids in enumerate(prompt_ids[:4])]
    sampled = run(loaded_tiny, requests, slots=2)
    assert [r.token_ids for r in sampled] == [generate_batch(loaded_tiny, [r])[0].token_ids for r in requests]
    assert any(r.token_ids != hf_greedy(loaded_tiny, ids, 12) for r, ids in zip(sampled, prompt_ids))


def test_a_request_longer_than_a_slot_is_decoded_alone_not_cut(loaded_tiny, prompt_ids, caplog):
    ids = prompt_ids[3]
    slot_tokens = len(ids) + 4  # fits the prompt, not its 30 new tokens
    results = run(loaded_tiny, [GenerationRequest(ids, 30), GenerationRequest(prompt_ids[2], 4)], slots=2,
                  slot_tokens=slot_tokens)
    assert results[0].token_ids == hf_greedy(loaded_tiny, ids, 30)
    assert results[1].token_ids == hf_greedy(loaded_tiny, prompt_ids[2], 4)
    assert "exceeds the longest slot (50 positions)" in caplog.text


def test_a_long_request_takes_a_long_slot_while_short_ones_go_on(loaded_tiny, prompt_ids, caplog):
    """One long slot beside two short ones: the request too long for a short slot decodes in the long pool,
    stepped in the same loop as the short requests, and nothing is decoded alone."""
    long_one = prompt_ids[3]
    slot_tokens = len(long_one) + 4  # the long request's 30 new tokens do not fit a short slot
    requests = [GenerationRequest(long_one, 30)] + [GenerationRequest(ids, 3) for ids in prompt_ids[:3]]
    long = SlotModel(loaded_tiny, slots=1, slot_tokens=256)
    prefilled, prefill = [], long.prefill
    long.prefill = lambda prompts, slots: prefilled.append([len(p) for p in prompts]) or prefill(prompts, slots)
    results = run(loaded_tiny, requests, slots=2, slot_tokens=slot_tokens, long=long)
    assert prefilled == [[len(long_one)]]  # the long pool took the long request, and only it
    assert [r.token_ids for r in results] == [hf_greedy(loaded_tiny, r.prompt_ids, r.max_new_tokens) for r in requests]
    assert "decoding it alone" not in caplog.text


def test_requests_submitted_from_many_threads_while_it_decodes(loaded_tiny, prompt_ids):
    scheduler = ContinuousScheduler(SlotModel(loaded_tiny, slots=4, slot_tokens=256), prefill_tokens=4096).start()
    results: dict[int, list[int]] = {}

    def client(index: int) -> None:
        ids = prompt_ids[index % len(prompt_ids)]
        results[index] = scheduler.submit(GenerationRequest(ids, 8 + index)).result(timeout=120).token_ids

    try:
        threads = [threading.Thread(target=client, args=(i,)) for i in range(10)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        scheduler.stop()
    for index in range(10):
        assert results[index] == hf_greedy(loaded_tiny, prompt_ids[index % len(prompt_ids)], 8 + index)


def test_an_empty_prompt_is_refused_at_submission(loaded_tiny):
    scheduler = ContinuousScheduler(SlotModel(loaded_tiny, slots=1, slot_tokens=16), prefill_tokens=64)
    with pytest.raises(ValueError):
        scheduler.submit(GenerationRequest([], 4))


def test_slot_logits_equal_the_full_forward_at_every_position(loaded_tiny, prompt_ids):
    """Logits, not only argmaxes: a taught tiny target picks the same token through small errors (attention that
    missed a row's own key still chose every token right), its logits do not."""
    import torch

    model = SlotModel(loaded_tiny, slots=3, slot_tokens=128)
    sequences = [ids + hf_greedy(loaded_tiny, ids, 10) for ids in prompt_ids[:3]]
    with torch.inference_mode():
        full = [loaded_tiny.model(torch.tensor([s])).logits[0] for s in sequences]  # (L, V) each
        # Slots 0 and 2 hold requests; slot 1 is free and passes position 0, as a step of the scheduler does.
        first = model.prefill([prompt_ids[0], prompt_ids[2]], [0, 2])
    torch.testing.assert_close(first[0], full[0][len(prompt_ids[0]) - 1], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(first[1], full[2][len(prompt_ids[2]) - 1], atol=1e-4, rtol=1e-4)
    for step in range(9):
        positions = [len(prompt_ids[0]) + step, 0, len(prompt_ids[2]) + step]
        ids = [sequences[0][positions[0]], 0, sequences[2][positions[2]]]
        logits = model.decode(ids, positions)
        torch.testing.assert_close(logits[0], full[0][positions[0]], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(logits[2], full[2][positions[2]], atol=1e-4, rtol=1e-4)


# ---- in the server -------------------------------------------------------------------------------------


def test_the_server_decodes_chat_continuously_when_told(tiny_model_dir, loaded_tiny, tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    from tests.services.inference.test_server import CHAT, chat_body, chat_prompt_ids, samples
    from tests.support.processes import ServiceProcess, free_port
    from tests.services.inference.conftest import InferenceServer

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {"DRAFTLINE_MODEL_DIR": str(tiny_model_dir), "DRAFTLINE_DATA": str(tmp_path / "data"),
           "DRAFTLINE_PORT": str(port), "DRAFTLINE_DEVICE": "cpu", "DRAFTLINE_DECODER": "continuous",
           "DRAFTLINE_DECODE_SLOTS": "3", "DRAFTLINE_SLOT_TOKENS": "512"}
    texts = ["Hi.", "Tell me about the lazy dog and the quick brown fox.", "1 2 3", "Write a list of fruits.", "x"]
    budgets = [12, 7, 25, 10, 18]
    with ServiceProcess("inference", env=env, log_dir=tmp_path / "logs", health_url=url + "/health") as process:
        server = InferenceServer(url, tmp_path / "data", process)
        with ThreadPoolExecutor(len(texts)) as pool:
            responses = list(pool.map(lambda tb: server.post(CHAT, chat_body(*tb)), zip(texts, budgets)))
        steps = samples(server, "draftline_inference_batch_size_bucket")
        assert "slot decoder: 3 slots of 512 positions" in process.full_log()
    for text, budget, response in zip(texts, budgets, responses):
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["token_ids"] == hf_greedy(loaded_tiny, chat_prompt_ids(loaded_tiny, text),
                                                                       budget)
    # Each decode step counts its rows: some step held several requests, none more than the three slots.
    total, one = steps[(("endpoint", CHAT), ("le", "+Inf"))], steps[(("endpoint", CHAT), ("le", "1.0"))]
    assert total > one and steps[(("endpoint", CHAT), ("le", "4.0"))] == total


def test_continuous_decoding_of_a_target_it_cannot_run_is_refused_by_name(loaded_tiny):
    from transformers import GPT2Config, GPT2LMHeadModel

    from services.inference.metrics import InferenceMetrics
    from services.inference.runtime import chat_decoder
    from services.inference.scheduler import ChatScheduler
    from services.inference.slots import UnsupportedTarget
    from shared.settings import InferenceSettings

    gpt2 = dataclasses.replace(loaded_tiny, model=GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2)))
    settings = InferenceSettings(model_dir=".", device="cpu", decoder="continuous")
    with pytest.raises(UnsupportedTarget, match="model type 'gpt2'"):
        chat_decoder(settings, gpt2, InferenceMetrics())
    auto = InferenceSettings(model_dir=".", device="cpu")
    assert isinstance(chat_decoder(auto, gpt2, InferenceMetrics()), ChatScheduler)
    assert isinstance(chat_decoder(auto, loaded_tiny, InferenceMetrics()), ChatScheduler)  # auto: CUDA only
