"""The vLLM source's own writing, without a vLLM server: an engine's states become a verified draftline file."""

from __future__ import annotations

import pytest
import torch

from services.extractor import vllm_source
from services.extractor.vllm_source import VllmHiddenStates
from services.inference import hidden
from shared import eagle3
from shared.hidden_file import verify_hidden_file

NUM_LAYERS = 8  # the tiny target's


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_both_sources_store_the_same_states_as_the_same_fp8_bytes(dtype):
    states = (torch.randn(6, 3 * 16) * torch.logspace(-3, 3, 48)).to(dtype)
    states[2] = 0.0  # a row of zeros keeps a positive scale in both
    name = "BF16" if dtype == torch.bfloat16 else "F32"
    ours = vllm_source.state_tensors(eagle3.AUX_HIDDEN, states, "fp8", name)
    stored = hidden.stored_states(states, states[:, :16], "fp8")
    theirs = {k: v for k, v in hidden.raw_states(stored, "fp8", name).items() if k in (eagle3.AUX_HIDDEN, eagle3.AUX_SCALE)}
    assert sorted(ours) == sorted(theirs) == [eagle3.AUX_HIDDEN, eagle3.AUX_SCALE]
    for key in ours:
        assert (ours[key].dtype, ours[key].shape) == (theirs[key].dtype, theirs[key].shape)
        assert bytes(ours[key].data) == bytes(theirs[key].data)
    assert ours[eagle3.AUX_SCALE].shape == (6, 3) and ours[eagle3.AUX_HIDDEN].dtype == "F8_E4M3"


@pytest.mark.parametrize("storage,dtype", [("target", "F32"), ("fp8", "F8_E4M3")])
def test_an_engine_file_becomes_a_verified_file_in_the_runs_storage(tmp_path, tiny_model_dir, storage, dtype):
    source = VllmHiddenStates("http://127.0.0.1:9", model="tiny", model_dir=tiny_model_dir, data=tmp_path,
                              storage=tmp_path / "engine", saved_layers=None, timeout_s=5)
    layers = eagle3.default_layer_ids(NUM_LAYERS)
    saved = eagle3.engine_saved_layers(layers, NUM_LAYERS)
    states = torch.randn(9, len(saved), 64)  # (T, saved layers, H) as vLLM stores them
    result = source._write(states, saved, layers, list(range(9)), [0] * 4 + [1] * 5, "s.safetensors", {"run": "r"},
                           storage)
    info = verify_hidden_file(tmp_path / "s.safetensors", layer_ids=layers, dtype=dtype, hidden_size=64,
                              sha256=result.sha256)
    assert (result.dtype, info.num_tokens, result.bytes) == (dtype, 9, info.nbytes)


LAYER_NORMS = ("model.layers.0.input_layernorm.weight", "model.layers.0.post_attention_layernorm.weight",
               "model.layers.1.input_layernorm.weight", "model.layers.2.shared_head.norm.weight")  # the last: an MTP layer's


def write_target(root, tensors: dict[str, torch.Tensor], *, shards: int = 1, config: dict | None = None):
    """A target directory of ``tensors`` in ``shards`` files (with ``model.safetensors.index.json`` when several)
    and a Kimi-K2.5-shaped config.json: the language model's fields under ``text_config``."""
    import json

    from safetensors.torch import save_file

    root.mkdir()
    config = config or {"model_type": "kimi_k25", "text_config": {"model_type": "kimi_k2", "rms_norm_eps": 1e-5}}
    (root / "config.json").write_text(json.dumps(config))
    names = sorted(tensors)
    files = {name: f"model-{i % shards + 1:05d}-of-{shards:05d}.safetensors" for i, name in enumerate(names)}
    for file in set(files.values()):
        save_file({name: tensors[name] for name in names if files[name] == file}, str(root / file))
    if shards > 1:
        (root / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": files}))
    return root


def layer_norms(prefix: str) -> dict[str, torch.Tensor]:
    return {prefix + name: torch.full((4,), 9.0) for name in LAYER_NORMS}


@pytest.mark.parametrize("prefix,shards", [
    ("", 1), ("language_model.", 3), ("", 2),
    ("text_model.", 1),  # a wrapper none of the known names covers: found by the suffix alone
])
def test_the_final_norm_is_found_under_a_wrappers_prefix_and_not_mistaken_for_a_layers(tmp_path, prefix, shards):
    weight = torch.arange(4.0)
    tensors = {**layer_norms(prefix), f"{prefix}model.norm.weight": weight, "vision_tower.final_layernorm.weight":
               torch.zeros(4), "mm_projector.pre_norm.weight": torch.zeros(4)}
    root = write_target(tmp_path / "target", tensors, shards=shards)
    norm, eps = vllm_source.final_norm(str(root))
    assert torch.equal(norm, weight) and eps == 1e-5


def test_the_newer_multimodal_layout_names_its_final_norm_after_the_language_model(tmp_path):
    weight = torch.arange(4.0)
    tensors = {**layer_norms("model.language_model."), "model.language_model.norm.weight": weight}
    norm, _ = vllm_source.final_norm(str(write_target(tmp_path / "target", tensors, shards=2)))
    assert torch.equal(norm, weight)


@pytest.mark.parametrize("shards", [1, 2])
def test_a_checkpoint_without_a_final_norm_fails_by_name(tmp_path, shards):
    root = write_target(tmp_path / "target", layer_norms("language_model."), shards=shards)
    with pytest.raises(vllm_source.FinalNormNotFound, match="none ends in 'model.norm.weight'"):
        vllm_source.final_norm(str(root))


def test_two_tensors_that_could_each_be_the_final_norm_fail_by_name(tmp_path):
    tensors = {"text_model.model.norm.weight": torch.ones(4), "vision_model.norm.weight": torch.ones(4)}
    with pytest.raises(vllm_source.FinalNormNotFound, match="several end in"):
        vllm_source.final_norm(str(write_target(tmp_path / "target", tensors)))


class DiesOnce:
    """A stand-in vLLM server on loopback: its first ``deaths`` completion requests schedule (write the
    request's ``.lock`` and a partial file, named after the request id as vLLM names them) and then the engine
    "dies": unanswered (the connection closes), or, ``after_answer``, once it has answered with the file's path
    but before its writer wrote the file. The next one answers as vLLM does, with its file's path."""

    def __init__(self, storage, hidden: int, layers: int, *, after_answer: bool = False, deaths: int = 1) -> None:
        import http.server
        import json
        import threading

        from safetensors.torch import save_file

        self.request_ids: list[str] = []
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_GET(self) -> None:  # health, for the dispatcher's wait for a server that went down
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                request_id = f"cmpl-{self.headers['X-Request-Id']}-0"
                outer.request_ids.append(request_id)
                engine_file = storage / f"{request_id}.safetensors"
                (storage / f"{request_id}.safetensors.lock").touch()
                dies = len(outer.request_ids) <= deaths
                if dies and not after_answer:
                    engine_file.write_bytes(b"half a file")
                    self.close_connection = True
                    return  # no answer: the client sees the server disconnect
                if not dies:
                    ids = torch.tensor(body["prompt"], dtype=torch.long)
                    save_file({"hidden_states": torch.randn(len(ids), layers, hidden), "token_ids": ids},
                              str(engine_file))
                answer = json.dumps({"kv_transfer_params": {"hidden_states_path": str(engine_file)}}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


def test_files_of_a_request_the_engine_died_on_are_removed_once_a_retry_succeeds(tmp_path, tiny_model_dir):
    engine, storage, layers, result = extract_from_dying_engine(tmp_path, tiny_model_dir, after_answer=False, deaths=1)
    assert len(engine.request_ids) == 2 and len(set(engine.request_ids)) == 2  # each attempt names its own request
    verify_hidden_file(tmp_path / "s.safetensors", layer_ids=layers, hidden_size=64, sha256=result.sha256)
    assert sorted(p.name for p in storage.iterdir()) == []  # the dead attempt's lock and half file went too


def extract_from_dying_engine(tmp_path, model_dir, *, after_answer: bool, deaths: int, retries: list[str] | None = None):
    """One sample extracted from a ``DiesOnce`` engine, three attempts allowed; (engine, storage, layers, result)."""
    from runtime.retry import RetryPolicy

    storage = tmp_path / "engine"
    storage.mkdir()
    layers = eagle3.default_layer_ids(NUM_LAYERS)
    saved = eagle3.engine_saved_layers(layers, NUM_LAYERS)
    engine = DiesOnce(storage, hidden=64, layers=len(saved), after_answer=after_answer, deaths=deaths)
    on_retry = None if retries is None else (lambda: retries.append("retry"))
    try:
        source = VllmHiddenStates(engine.url, model="tiny", model_dir=model_dir, data=tmp_path, storage=storage,
                                  saved_layers=saved, timeout_s=10,
                                  policy=RetryPolicy(max_attempts=3, base_delay_s=0.01, max_delay_s=0.01, jitter=False,
                                                     wait_max_s=5))
        result = source.extract(input_ids=list(range(7)), loss_mask=[0] * 3 + [1] * 4, path="s.safetensors",
                                layer_ids=layers, metadata={"run": "r"}, on_retry=on_retry)
    finally:
        engine.server.shutdown()
    return engine, storage, layers, result


def test_a_sample_whose_engine_died_after_answering_is_asked_again(tmp_path, tiny_model_dir):
    """The engine answers, then dies before its writer writes the file (it writes after the answer): the lock is
    free and no file is there. That was a failed sample (the vLLM pipeline test's one failure in CI); it is
    asked for again, and the retry counted."""
    retries: list[str] = []
    engine, storage, layers, result = extract_from_dying_engine(tmp_path, tiny_model_dir, after_answer=True,
                                                                 deaths=1, retries=retries)
    assert len(engine.request_ids) == 2 and retries == ["retry"]
    verify_hidden_file(tmp_path / "s.safetensors", layer_ids=layers, hidden_size=64, sha256=result.sha256)
    assert sorted(p.name for p in storage.iterdir()) == []


def test_an_engine_that_never_writes_its_files_fails_the_sample_by_name(tmp_path, tiny_model_dir):
    with pytest.raises(vllm_source.EngineFileLost, match="no whole engine hidden-state file"):
        extract_from_dying_engine(tmp_path, tiny_model_dir, after_answer=True, deaths=3)
    assert not (tmp_path / "s.safetensors").exists()
