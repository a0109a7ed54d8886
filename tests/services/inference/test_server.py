"""``draftline serve inference`` as a real process, over HTTP."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from safetensors.torch import load_file

from services.inference.model import model_fingerprint
from services.inference.reasoning import split_reasoning
from shared import eagle3
from shared.atomic import temp_files
from shared.hidden_file import verify_hidden_file
from shared.layout import RunPaths

CHAT = "/v1/chat/completions"
HIDDEN = "/v1/hidden_states"


def samples(server, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    """Every sample of one metric family from /metrics, keyed by its sorted labels."""
    text = server.get("/metrics").text
    found = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                found[tuple(sorted(sample.labels.items()))] = sample.value
    return found


def chat_body(text: str, max_tokens: int, **extra) -> dict:
    return {"messages": [{"role": "user", "content": text}], "max_tokens": max_tokens, "temperature": 0,
            "return_token_ids": True, **extra}


def hf_greedy(loaded, prompt_ids: list[int], max_new: int) -> list[int]:
    out = loaded.model.generate(torch.tensor([prompt_ids]), do_sample=False, max_new_tokens=max_new)
    return out[0, len(prompt_ids):].tolist()


def chat_prompt_ids(loaded, text: str) -> list[int]:
    rendered = loaded.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                    tokenize=False)
    return loaded.tokenizer(rendered, add_special_tokens=False)["input_ids"]


# -- health, models, metrics -------------------------------------------------------------------


def test_health_names_the_model_and_its_fingerprint(inference_server, tiny_model_dir):
    body = inference_server.get("/health").json()
    assert body == {"status": "ok", "model": tiny_model_dir.name, "fingerprint": model_fingerprint(tiny_model_dir)}


def test_models_lists_the_target_with_what_extraction_needs(inference_server, tiny_model_dir, loaded_tiny):
    body = inference_server.get("/v1/models").json()
    assert body["object"] == "list"
    (card,) = body["data"]
    assert (card["id"], card["object"]) == (tiny_model_dir.name, "model")
    assert card["draftline"] == {
        "fingerprint": model_fingerprint(tiny_model_dir),
        "num_layers": 8,
        "hidden_size": 64,
        "vocab_size": loaded_tiny.vocab_size,
        "default_layer_ids": eagle3.default_layer_ids(8),
        "layer_convention": eagle3.LAYER_CONVENTION,
        "dtype": "F32",
        "max_position_embeddings": 4096,
    }


def test_metrics_count_requests_by_route_and_status(inference_server):
    key = (("endpoint", CHAT), ("status", "404"))
    before = samples(inference_server, "draftline_inference_requests_total").get(key, 0.0)
    assert inference_server.post(CHAT, chat_body("hi", 2, model="no-such-model")).status_code == 404
    after = samples(inference_server, "draftline_inference_requests_total")
    assert after[key] == before + 1
    durations = samples(inference_server, "draftline_inference_request_duration_seconds_count")
    assert durations[(("endpoint", "/health"),)] >= 1


# -- chat completions --------------------------------------------------------------------------


def test_greedy_chat_equals_hf_generate(inference_server, loaded_tiny):
    text = "What is speculative decoding?"
    response = inference_server.post(CHAT, chat_body(text, 20))
    assert response.status_code == 200, response.text
    body = response.json()
    prompt_ids = chat_prompt_ids(loaded_tiny, text)
    expected = hf_greedy(loaded_tiny, prompt_ids, 20)
    (choice,) = body["choices"]
    assert body["prompt_token_ids"] == prompt_ids
    assert choice["token_ids"] == expected
    assert body["object"] == "chat.completion" and body["model"] == loaded_tiny.name and body["id"]
    assert choice["message"]["role"] == "assistant"
    stopped = expected[-1] in loaded_tiny.eos_token_ids
    assert choice["finish_reason"] == ("stop" if stopped else "length")
    reasoning, content = split_reasoning(loaded_tiny.tokenizer.decode(expected, skip_special_tokens=True), enabled=True)
    assert choice["message"] == {"role": "assistant", "content": content, "reasoning_content": reasoning}
    assert body["usage"] == {"prompt_tokens": len(prompt_ids), "completion_tokens": len(expected),
                             "total_tokens": len(prompt_ids) + len(expected)}


def test_max_completion_tokens_wins_and_model_name_may_be_given(inference_server, loaded_tiny):
    body = chat_body("Count to ten.", 30, max_completion_tokens=3, model=loaded_tiny.name)
    choice = inference_server.post(CHAT, body).json()["choices"][0]
    assert len(choice["token_ids"]) <= 3


def test_concurrent_requests_are_batched_and_each_equals_its_unbatched_output(inference_server, loaded_tiny):
    texts = ["Hi.", "Tell me about the lazy dog and the quick brown fox.", "1 2 3", "Write a list of fruits, please."]
    budgets = [12, 7, 15, 10]
    batches = "draftline_inference_batch_size_bucket"
    before = samples(inference_server, batches)
    with ThreadPoolExecutor(len(texts)) as pool:
        responses = list(pool.map(lambda tb: inference_server.post(CHAT, chat_body(*tb)), zip(texts, budgets)))
    after = samples(inference_server, batches)

    one = (("endpoint", CHAT), ("le", "1.0"))
    total = (("endpoint", CHAT), ("le", "+Inf"))
    larger = (after[total] - before.get(total, 0)) - (after[one] - before.get(one, 0))
    assert larger >= 1, "no chat batch of more than one request was decoded"
    for text, budget, response in zip(texts, budgets, responses):
        assert response.status_code == 200, response.text
        expected = hf_greedy(loaded_tiny, chat_prompt_ids(loaded_tiny, text), budget)
        assert response.json()["choices"][0]["token_ids"] == expected


def test_seeded_sampling_repeats_itself(inference_server):
    body = chat_body("Say something random.", 12, temperature=1.0, top_p=0.9, seed=1234)
    first, second = (inference_server.post(CHAT, body).json() for _ in range(2))
    assert first["choices"][0]["token_ids"] == second["choices"][0]["token_ids"]


def test_prompt_longer_than_the_context_is_refused_with_a_reason(inference_server):
    response = inference_server.post(CHAT, chat_body(" ".join(["word"] * 5000), 4))
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["type"] == "PromptTooLong" and "context" in error["message"]


def test_unknown_model_is_404_like_vllm(inference_server):
    response = inference_server.post(CHAT, chat_body("hi", 2, model="gpt-nothing"))
    assert response.status_code == 404
    assert response.json()["error"]["message"] == "The model `gpt-nothing` does not exist."


@pytest.mark.parametrize("body", [
    {},
    {"messages": []},
    {"messages": "hello"},
    {"messages": [{"content": "no role"}]},
    {"messages": [{"role": "user", "content": 5}]},
    {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
    {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0},
    {"messages": [{"role": "user", "content": "hi"}], "max_tokens": "many"},
    {"messages": [{"role": "user", "content": "hi"}], "temperature": -1},
    {"messages": [{"role": "user", "content": "hi"}], "top_p": 0},
    {"messages": [{"role": "user", "content": "hi"}], "n": 2},
    {"messages": [{"role": "user", "content": "hi"}], "stream": True},
    {"messages": [{"role": "user", "content": "hi"}], "stop": ["\n"]},
    {"messages": [{"role": "user", "content": "hi"}], "seed": -3},
    {"messages": [{"role": "user"}]},  # the template cannot concatenate a missing content
    [1, 2, 3],
])
def test_malformed_chat_bodies_are_4xx_with_a_message(inference_server, body):
    response = inference_server.post(CHAT, body)
    assert response.status_code in (400, 422), response.text
    assert response.json()["error"]["message"]


def test_invalid_json_and_streaming_refusal_say_why(inference_server):
    response = httpx.post(inference_server.url + CHAT, content=b'{"messages": [', timeout=30,
                          headers={"content-type": "application/json"})
    assert response.status_code == 400 and "JSON" in response.json()["error"]["message"]
    stream = inference_server.post(CHAT, chat_body("hi", 2, stream=True)).json()["error"]["message"]
    assert "streaming is not supported" in stream


# -- hidden states -----------------------------------------------------------------------------


def hidden_body(loaded, path: str, length: int, seed: int, **extra) -> dict:
    ids = torch.randint(0, loaded.vocab_size, (length,), generator=torch.Generator().manual_seed(seed)).tolist()
    return {"input_ids": ids, "loss_mask": [int(i % 3 == 0) for i in range(length)], "path": path, **extra}


def test_hidden_state_files_verify_and_equal_a_direct_forward(inference_server, loaded_tiny):
    volume = inference_server.data
    bodies = [hidden_body(loaded_tiny, f"runs/demo/hidden_states/rows_000000-001999/{i:08d}.safetensors", n, i,
                          metadata={"sample_id": str(i), "run": "demo"})
              for i, n in enumerate([40, 7, 90, 23, 61])]
    bodies[3]["layer_ids"] = [0, 2, 5]
    bodies[4]["path"] = str(volume / "runs/demo/hidden_states/absolute-inside.safetensors")
    with ThreadPoolExecutor(len(bodies)) as pool:
        responses = list(pool.map(lambda b: inference_server.post(HIDDEN, b), bodies))

    for body, response in zip(bodies, responses):
        assert response.status_code == 200, response.text
        result = response.json()
        layers = body.get("layer_ids", [1, 3, 4])
        path = volume / result["path"]
        assert not Path(result["path"]).is_absolute() and path == volume / Path(body["path"]).relative_to(
            volume if Path(body["path"]).is_absolute() else "")
        n = len(body["input_ids"])
        assert result["num_tokens"] == n and result["layer_ids"] == layers and result["dtype"] == "F32"
        assert result["layer_convention"] == eagle3.LAYER_CONVENTION
        assert result["shapes"]["aux_hidden_states"] == [n, 192] and result["shapes"]["hidden_states"] == [n, 64]
        info = verify_hidden_file(path, layer_ids=layers, dtype="F32", hidden_size=64, sha256=result["sha256"])
        assert info.nbytes == result["bytes"]
        assert info.metadata["sample_id"] == body["metadata"]["sample_id"]
        assert info.metadata[eagle3.META_MODEL_FINGERPRINT] == loaded_tiny.fingerprint

        tensors = load_file(path)
        assert tensors["input_ids"].tolist() == body["input_ids"]
        assert tensors["loss_mask"].tolist() == body["loss_mask"]
        with torch.inference_mode():
            out = loaded_tiny.model(torch.tensor([body["input_ids"]]), output_hidden_states=True)
        aux = torch.cat([out.hidden_states[eagle3.hf_hidden_index(i)] for i in layers], dim=-1)[0]
        assert torch.allclose(tensors["aux_hidden_states"], aux, atol=1e-4, rtol=1e-4)
        assert torch.allclose(tensors["hidden_states"], out.hidden_states[-1][0], atol=1e-4, rtol=1e-4)
        with torch.inference_mode():
            logits = loaded_tiny.model.lm_head(tensors["hidden_states"])
        assert torch.allclose(logits, out.logits[0], atol=1e-4, rtol=1e-4)
    assert samples(inference_server, "draftline_inference_hidden_state_bytes_total")[()] >= sum(
        r.json()["bytes"] for r in responses)
    assert temp_files(volume) == []


def test_rewriting_a_sample_replaces_the_file_atomically(inference_server, loaded_tiny):
    path = "runs/demo/hidden_states/rewrite.safetensors"
    first = inference_server.post(HIDDEN, hidden_body(loaded_tiny, path, 12, 1)).json()
    second = inference_server.post(HIDDEN, hidden_body(loaded_tiny, path, 30, 2)).json()
    info = verify_hidden_file(inference_server.data / path, sha256=second["sha256"])
    assert info.num_tokens == 30 and first["sha256"] != second["sha256"]


def test_paths_outside_the_volume_are_refused_and_nothing_is_written(inference_server, loaded_tiny, tmp_path):
    volume = inference_server.data
    outside = tmp_path / "outside"
    outside.mkdir()
    os.symlink(outside, volume / "escape-link")
    attempts = [
        str(outside / "absolute.safetensors"),
        "../escaped.safetensors",
        "runs/../../escaped-deeper.safetensors",
        "escape-link/through-symlink.safetensors",
    ]
    before = sorted(p for p in volume.rglob("*"))
    for path in attempts:
        response = inference_server.post(HIDDEN, hidden_body(loaded_tiny, path, 5, 0))
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["type"] == "PathOutsideVolume" and "outside the data volume" in error["message"]
    assert list(outside.iterdir()) == []
    assert not (volume.parent / "escaped.safetensors").exists()
    assert not (volume.parent.parent / "escaped-deeper.safetensors").exists()
    assert sorted(p for p in volume.rglob("*")) == before


def test_paths_on_the_volume_outside_a_runs_hidden_state_directory_are_403(inference_server, loaded_tiny):
    volume = inference_server.data
    export = volume / "runs/victim/drafter/export"
    export.mkdir(parents=True)
    (export / "model.safetensors").write_bytes(b"the exported drafter")
    (volume / "runs/victim/hidden_states").mkdir()
    os.symlink(export, volume / "runs/victim/hidden_states/to-export")
    attempts = [
        "runs/victim/drafter/export/model.safetensors",  # an exported drafter
        str(export / "model.safetensors"),
        "runs/victim/hidden_states/../drafter/export/model.safetensors",
        "runs/victim/hidden_states/to-export/model.safetensors",  # a link inside that leads out
        "runs/victim/model.safetensors",
        "runs/hidden_states/x.safetensors",  # no run
        "runs/bad..name/hidden_states/x.safetensors",  # no valid run name
        "models/tiny/model.safetensors",
        "x.safetensors",
    ]
    before = {p: p.read_bytes() for p in volume.rglob("*") if p.is_file()}
    for path in attempts:
        response = inference_server.post(HIDDEN, hidden_body(loaded_tiny, path, 5, 0))
        assert response.status_code == 403, (path, response.text)
        error = response.json()["error"]
        assert error["type"] == "PermissionDeniedError", path
        assert "<data>/runs/<run>/hidden_states/" in error["message"] and str(volume) in error["message"], path
    assert {p: p.read_bytes() for p in volume.rglob("*") if p.is_file()} == before
    # What the extractor sends (RunPaths.hidden_relative) is written.
    allowed = RunPaths(volume, "victim").hidden_relative(7)
    assert inference_server.post(HIDDEN, hidden_body(loaded_tiny, allowed, 5, 0)).status_code == 200
    assert (volume / allowed).is_file()


def test_sample_longer_than_the_context_is_refused(inference_server, loaded_tiny):
    response = inference_server.post(HIDDEN, hidden_body(loaded_tiny, "runs/demo/hidden_states/long.safetensors", 4097, 0))
    assert response.status_code == 400
    assert response.json()["error"]["type"] == "PromptTooLong"
    assert not (inference_server.data / "runs/demo/hidden_states/long.safetensors").exists()


@pytest.mark.parametrize("change", [
    {"input_ids": []},
    {"input_ids": [1, -2, 3], "loss_mask": [0, 1, 1]},
    {"input_ids": [1, 10**6, 3], "loss_mask": [0, 1, 1]},
    {"input_ids": ["a", "b", "c"], "loss_mask": [0, 1, 1]},
    {"loss_mask": [0, 1]},
    {"loss_mask": [0, 2, 1]},
    {"path": "runs/demo/hidden_states/x.pt"},
    {"path": ""},
    {"path": "runs/demo/hidden_states/.safetensors"},
    {"path": "runs/demo/hidden_states"},
    {"layer_ids": [1, 3]},
    {"layer_ids": [1, 3, 99]},
    {"metadata": {"sample_id": 3}},
    {"metadata": {"format": "mine"}},
    {"storage": "fp4"},
    {"storage": "F8_E4M3"},
    {"surprise": True},
])
def test_malformed_hidden_state_bodies_are_4xx_and_write_nothing(inference_server, change):
    body = {"input_ids": [1, 2, 3], "loss_mask": [0, 1, 1], "path": "runs/demo/hidden_states/malformed.safetensors",
            **change}
    response = inference_server.post(HIDDEN, body)
    assert response.status_code in (400, 422), response.text
    assert response.json()["error"]["message"]
    assert not (inference_server.data / "runs/demo/hidden_states/malformed.safetensors").exists()
