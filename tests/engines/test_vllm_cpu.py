"""A real vLLM (CPU build) against transformers on the same weights: real server, real HTTP, no mocks.

One server serves the module (tests/engines/conftest.py): it generates chat replies and, through the
``extract_hidden_states`` speculative method and draftline's CPU connector, saves the hidden states of
every request. The tests pin down what the extractor relies on: the reply's token ids are the target's
greedy decode of the chat template's prompt ids; a prefill-only request over token ids saves every
token's states, which are transformers' ``hidden_states`` at the requested layer ids.
"""

from __future__ import annotations

import fcntl
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch

from tests.engines.target64 import CHUNK_TOKENS
from tests.support.vllm_server import VLLMTarget

pytestmark = pytest.mark.slow

QUESTIONS = ("Give me three bullet points about tea.", "What is the most common misconception about Python?")
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def hf(tiny64_dir: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny64_dir, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(tiny64_dir)


def post(target: VLLMTarget, path: str, body: dict) -> tuple[dict, float]:
    started = time.monotonic()
    response = httpx.post(f"{target.url}{path}", json={"model": target.model, **body}, timeout=120)
    assert response.status_code == 200, f"{response.status_code} {response.text}; server log {target.log_path}"
    return response.json(), time.monotonic() - started


def load_states(path: str) -> dict[str, torch.Tensor]:
    """The connector's file, read once its writer released the ``.lock`` (it holds LOCK_EX while writing,
    and the response can arrive before the write ends)."""
    from safetensors.torch import load_file

    with open(path + ".lock") as lock:
        fcntl.flock(lock, fcntl.LOCK_SH)
        return load_file(path)


def chat(target: VLLMTarget, question: str, **extra) -> tuple[dict, float]:
    return post(target, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": question}], "max_tokens": MAX_TOKENS, "temperature": 0,
        "return_token_ids": True, **extra,
    })


def hf_states(model, ids: list[int]) -> tuple[list[torch.Tensor], torch.Tensor]:
    """transformers' ``hidden_states`` (embeddings, then each layer's output; the last one after the
    final norm) and the last decoder layer's output before that norm."""
    captured = {}
    hook = model.model.layers[-1].register_forward_hook(
        lambda module, args, output: captured.setdefault("last", output[0] if isinstance(output, tuple) else output))
    try:
        with torch.no_grad():
            out = model(input_ids=torch.tensor([ids]), output_hidden_states=True)
    finally:
        hook.remove()
    return [h[0] for h in out.hidden_states], captured["last"][0]


def max_diff(actual: torch.Tensor, expected: torch.Tensor) -> float:
    assert actual.shape == expected.shape
    return (actual - expected).abs().max().item()


def assert_close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> float:
    """float32 agreement relative to the states' size (this model's states reach ~100)."""
    diff = max_diff(actual, expected)
    bound = 1e-5 * max(1.0, expected.abs().max().item())
    assert diff <= bound, f"{what}: max abs diff {diff:.3g} > {bound:.3g}"
    return diff


@pytest.mark.parametrize("question", QUESTIONS)
def test_chat_reply_is_the_targets_greedy_decode(vllm_tiny64: VLLMTarget, hf, question: str) -> None:
    model, tokenizer = hf
    body, seconds = chat(vllm_tiny64, question)
    prompt_ids = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                               tokenize=True, return_dict=True)["input_ids"]
    assert body["prompt_token_ids"] == prompt_ids
    reply_ids = body["choices"][0]["token_ids"]
    with torch.no_grad():
        greedy = model.generate(torch.tensor([prompt_ids]), max_new_tokens=MAX_TOKENS, do_sample=False)
    assert reply_ids == greedy[0, len(prompt_ids):].tolist()
    assert body["usage"]["completion_tokens"] == len(reply_ids)
    print(f"vLLM start-up {vllm_tiny64.startup_s:.1f}s; chat reply of {len(reply_ids)} tokens in {seconds:.2f}s")


def test_prefill_only_request_saves_every_tokens_states(vllm_tiny64: VLLMTarget, hf) -> None:
    model, _ = hf
    reply, _ = chat(vllm_tiny64, QUESTIONS[0])
    ids = reply["prompt_token_ids"] + reply["choices"][0]["token_ids"]
    started = time.monotonic()
    body, answered = post(vllm_tiny64, "/v1/completions", {
        "prompt": ids, "max_tokens": 1, "temperature": 0, "return_token_ids": True})
    assert body["choices"][0]["prompt_token_ids"] == ids  # token ids in, never re-tokenized text
    path = body["kv_transfer_params"]["hidden_states_path"]
    assert Path(path).parent == vllm_tiny64.storage
    saved = load_states(path)
    readable = time.monotonic() - started
    assert set(saved) == {"hidden_states", "token_ids"}
    states = saved["hidden_states"]
    assert states.dtype == torch.float32 and saved["token_ids"].dtype == torch.int64
    assert saved["token_ids"].tolist() == ids
    assert states.shape == (len(ids), len(vllm_tiny64.layer_ids), model.config.hidden_size)

    expected, last_before_norm = hf_states(model, ids)
    last = len(model.model.layers)
    diffs = {}
    for slot, layer_id in enumerate(vllm_tiny64.layer_ids):  # the file keeps the ids' ascending order
        if layer_id < last:
            diffs[layer_id] = assert_close(states[:, slot], expected[layer_id], f"layer id {layer_id}")
        else:
            diffs[layer_id] = assert_close(states[:, slot], last_before_norm, f"layer id {layer_id} (last layer)")
            with torch.no_grad():
                normed = model.model.norm(states[:, slot])
            diffs["norm(L)"] = assert_close(normed, expected[last], "final norm of the last layer's state")
    print(f"extraction of {len(ids)} tokens: response in {answered:.2f}s, file read at {readable:.2f}s; "
          f"max abs diff by layer id {diffs}")


def test_concurrent_extractions_each_save_their_own_states(vllm_tiny64: VLLMTarget, hf) -> None:
    model, tokenizer = hf
    sequences = [tokenizer(f"{question} {n}")["input_ids"] for n, question in enumerate(QUESTIONS * 3)]
    with ThreadPoolExecutor(len(sequences)) as pool:
        bodies = list(pool.map(lambda ids: post(vllm_tiny64, "/v1/completions", {
            "prompt": ids, "max_tokens": 1, "temperature": 0})[0], sequences))
    paths = {body["kv_transfer_params"]["hidden_states_path"] for body in bodies}
    assert len(paths) == len(sequences)
    middle = vllm_tiny64.layer_ids.index(2)
    for ids, body in zip(sequences, bodies):
        saved = load_states(body["kv_transfer_params"]["hidden_states_path"])
        assert saved["token_ids"].tolist() == ids
        assert_close(saved["hidden_states"][:, middle], hf_states(model, ids)[0][2], "layer id 2")


def test_generating_request_saves_all_but_its_last_token(vllm_tiny64: VLLMTarget, hf) -> None:
    """A request that generates saves its prompt's states only, or with ``include_output_tokens`` every
    token but the last: that one was sampled, never fed back through the model."""
    model, _ = hf
    plain, _ = chat(vllm_tiny64, QUESTIONS[1])
    prompt_ids, reply_ids = plain["prompt_token_ids"], plain["choices"][0]["token_ids"]
    assert load_states(plain["kv_transfer_params"]["hidden_states_path"])["token_ids"].tolist() == prompt_ids
    full, _ = chat(vllm_tiny64, QUESTIONS[1], kv_transfer_params={"include_output_tokens": True})
    assert full["choices"][0]["token_ids"] == reply_ids
    saved = load_states(full["kv_transfer_params"]["hidden_states_path"])
    assert saved["token_ids"].tolist() == (prompt_ids + reply_ids)[:-1]
    middle = vllm_tiny64.layer_ids.index(2)
    # the reply's states were computed one decode step at a time, and still are the prefill's
    assert_close(saved["hidden_states"][:, middle], hf_states(model, saved["token_ids"].tolist())[0][2], "layer id 2")


def prefix_cache_hits(target: VLLMTarget) -> float:
    metrics = httpx.get(f"{target.url}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
               if line.startswith("vllm:prefix_cache_hits_total"))


def test_chunked_and_prefix_cached_prefills_save_the_same_states(vllm_tiny64: VLLMTarget, hf) -> None:
    """A prompt longer than a prefill chunk is prefilled in steps; sent again, its leading blocks come
    from the prefix cache and are not recomputed. Both files hold transformers' states."""
    model, _ = hf
    generator = torch.Generator().manual_seed(0)
    ids = [1, *torch.randint(4, model.config.vocab_size, (CHUNK_TOKENS * 2 + 100,), generator=generator).tolist()]
    expected = hf_states(model, ids)[0]
    hits_before = prefix_cache_hits(vllm_tiny64)
    for _ in range(2):
        body, _ = post(vllm_tiny64, "/v1/completions", {"prompt": ids, "max_tokens": 1, "temperature": 0})
        saved = load_states(body["kv_transfer_params"]["hidden_states_path"])
        assert saved["token_ids"].tolist() == ids
        for slot, layer_id in enumerate(vllm_tiny64.layer_ids[:-1]):
            assert_close(saved["hidden_states"][:, slot], expected[layer_id], f"layer id {layer_id}")
    assert prefix_cache_hits(vllm_tiny64) > hits_before, "the second request did not reuse the prefix cache"
