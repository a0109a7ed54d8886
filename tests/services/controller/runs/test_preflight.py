"""Preflight with real parts, each check failing on purpose: a stopped Redis, an absent or different
inference server, a tmpfs or read-only data directory, a full volume, a base checkpoint from an offline
Hub cache or missing; and a real controller answering 412 until the run is fixed or forced."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import httpx
import pytest

from services.controller.runs import preflight as pf
from services.controller.api import preflight_command
from shared.atomic import temp_files
from shared.runspec import (
    EvalConfig,
    ExtractionConfig,
    GenerationConfig,
    RunSpec,
    TrainConfig,
)
from runtime.disk import format_bytes
from runtime.disk_training import training_bytes
from shared.layout import RunPaths
from shared.settings import ControllerSettings
from tests.services.controller.runs.test_datasets import write_jsonl
from tests.support.openai_server import OpenAIServer
from tests.support.processes import RedisServer, ServiceProcess, free_port
from tests.support.tmpfs import mounted_tmpfs

HUB_REPO = "owner/drafter"
COMMIT = "89abcdef0123456789abcdef0123456789abcdef"
TINY_CARD = {"id": "tiny", "draftline": {"hidden_size": 64, "dtype": "F32", "vocab_size": 774}}


def check(report: pf.PreflightReport, name: str) -> pf.Check:
    return next(c for c in report.checks if c.name == name)


def settings_for(data: Path, **overrides) -> ControllerSettings:
    values = {"data": data, "redis_url": f"redis://127.0.0.1:{free_port()}/0",
              "inference_url": f"http://127.0.0.1:{free_port()}", "disk_reserve_bytes": 0,
              "disk_reserve_fraction": 0.0, **overrides}
    return ControllerSettings(**values)


def spec_for(dataset: Path, **overrides) -> RunSpec:
    values = {"name": "pre", "dataset": str(dataset), "model": "tiny", "generation": GenerationConfig(max_tokens=32),
              "evaluate": EvalConfig(holdout=2), **overrides}
    return RunSpec(**values)


@pytest.fixture()
def persistent_dir():
    """A directory outside /tmp on a disk, as a real volume would be (/var/tmp survives reboots)."""
    if pf.mount_of(Path("/var/tmp"))[1] in pf.EPHEMERAL_FS:
        pytest.skip("/var/tmp is a tmpfs on this machine: no persistent directory to test with")
    path = Path(tempfile.mkdtemp(dir="/var/tmp", prefix="draftline-preflight-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture()
def dataset(tmp_path) -> Path:
    return write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": f"question number {i}"} for i in range(40)])


@pytest.fixture(scope="module")
def tiny_server(tiny_model_dir, tmp_path_factory):
    """The built-in inference server on the tiny target, as ``draftline serve inference`` runs it."""
    port = free_port()
    env = {"DRAFTLINE_MODEL_DIR": str(tiny_model_dir), "DRAFTLINE_DATA": str(tmp_path_factory.mktemp("inference-data")),
           "DRAFTLINE_HOST": "127.0.0.1", "DRAFTLINE_PORT": str(port), "DRAFTLINE_DEVICE": "cpu"}
    with ServiceProcess("inference", env=env, log_dir=tmp_path_factory.mktemp("logs"),
                        health_url=f"http://127.0.0.1:{port}/health"):
        yield f"http://127.0.0.1:{port}"


@pytest.fixture(scope="module")
def exported_drafter(tiny_model_dir, tmp_path_factory) -> Path:
    """A real drafter export for the tiny target, written and verified by the trainer's exporter."""
    import torch

    from modeling.export import export_drafter
    from modeling.eagle3 import DrafterConfig, Eagle3Drafter
    from modeling.target_head import load_target_head
    from services.trainer.vocab import build_mapping

    target = json.loads((tiny_model_dir / "config.json").read_text())
    torch.manual_seed(0)
    drafter = Eagle3Drafter(DrafterConfig.from_target_config(target, draft_vocab_size=64, layer_ids=[1, 3, 4]))
    drafter.load_embedding(load_target_head(tiny_model_dir).embed)
    drafter.set_vocab_mapping(*build_mapping(torch.arange(target["vocab_size"]) % 5, 64))
    return export_drafter(drafter, tmp_path_factory.mktemp("drafter") / "export", target_model="tiny",
                          target_fingerprint="0" * 64, dtype=torch.float32)


def make_model_hub_cache(cache: Path, repo_id: str, source: Path) -> None:
    """What huggingface_hub writes for a model repo: blobs, refs/main, snapshots/<sha>/ linking to blobs."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)
    for file in source.iterdir():
        content = file.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(content).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(content)
        link = repo / "snapshots" / COMMIT / file.name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))


# ---- every check passing ---------------------------------------------------------------------------


def test_every_check_passes_against_real_parts(redis_url, tiny_server, tiny_model_dir, persistent_dir, dataset):
    settings = settings_for(persistent_dir, redis_url=redis_url, inference_url=tiny_server, model_dir=tiny_model_dir)
    report = pf.run_preflight(settings, spec=spec_for(dataset, model=tiny_model_dir.name))
    assert report.ok and report.allowed, pf.format_preflight(report)
    # A CI container may keep /var/tmp in its own overlay; that alone is a warning, never a refusal.
    assert [c.name for c in report.warnings] in ([], ["data directory persistent"]), pf.format_preflight(report)
    assert "the served model is the target" in check(report, "target fingerprint").message
    assert report.bytes_per_token == 4 * 64 * 4 + 9  # read from the served model's card: hidden 64, fp32
    assert "38 samples" in check(report, "disk space").message  # 40 rows, 2 held out
    assert list(persistent_dir.iterdir()) == []  # the write probe is gone


# ---- each check failing on purpose ----------------------------------------------------------------


def test_a_stopped_redis_is_named_with_its_fix(tmp_path):
    server = RedisServer(tmp_path / "redis").start()
    server.stop()
    found = pf.check_redis(settings_for(tmp_path, redis_url=server.url))
    assert (found.ok, found.severity) == (False, pf.ERROR)
    assert server.url in found.message and "does not answer" in found.message
    assert "REDIS_URL" in found.fix


def test_a_redis_password_never_reaches_the_message(tmp_path):
    found = pf.check_redis(settings_for(tmp_path, redis_url=f"redis://:s3cret@127.0.0.1:{free_port()}/0"))
    assert not found.ok and "s3cret" not in found.message and ":***@" in found.message


def test_an_absent_inference_server_is_named(tmp_path, dataset):
    settings = settings_for(tmp_path)
    report = pf.run_preflight(settings, spec=spec_for(dataset))
    found = check(report, "inference server")
    assert not found.ok and found.severity == pf.ERROR
    assert settings.inference_url in found.message and "DRAFTLINE_INFERENCE_URL" in found.fix
    assert not report.allowed and pf.run_preflight(settings, force=True).allowed


def test_a_server_of_another_model_is_named(tmp_path, dataset):
    with OpenAIServer(model="served-name") as served:
        found = pf.check_inference(settings_for(tmp_path, inference_url=served.url),
                                   spec_for(dataset, model="expected-model"), pf.Facts())
    assert not found.ok
    assert "'expected-model'" in found.message and "served-name" in found.message
    assert "served-name" in found.fix


def test_a_served_target_other_than_the_model_dir_is_named(tmp_path, tiny_server, tiny_model_dir, dataset):
    other = tmp_path / "other-target"
    other.mkdir()
    config = json.loads((tiny_model_dir / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "rope_theta": 12345.0}))
    report = pf.run_preflight(settings_for(tmp_path, inference_url=tiny_server, model_dir=other),
                              spec=spec_for(dataset, model=tiny_model_dir.name))
    found = check(report, "target fingerprint")
    assert not found.ok and found.severity == pf.ERROR
    assert str(other) in found.message and "DRAFTLINE_MODEL_DIR" in found.fix


def test_layer_ids_outside_the_served_target_are_refused_before_any_generation(tmp_path, tiny_server, tiny_model_dir,
                                                                               dataset):
    settings = settings_for(tmp_path, inference_url=tiny_server)
    bad = pf.run_preflight(settings, spec=spec_for(dataset, model=tiny_model_dir.name,
                                                   extraction=ExtractionConfig(layer_ids=[1, 3, 8])))
    found = check(bad, "layer ids")
    assert (found.ok, found.severity) == (False, pf.ERROR) and not bad.allowed
    assert "layer id 8 is outside the target's 8 layers" in found.message and "0..6" in found.fix
    good = pf.run_preflight(settings, spec=spec_for(dataset, model=tiny_model_dir.name,
                                                    extraction=ExtractionConfig(layer_ids=[0, 3, 6])))
    assert check(good, "layer ids").ok


def test_layer_ids_are_read_from_the_model_dir_when_the_server_does_not_say(tmp_path, dataset):
    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text(json.dumps({"num_hidden_layers": 61}))  # Kimi-K2's count
    spec = spec_for(dataset, extraction=ExtractionConfig(layer_ids=[1, 29, 61]))
    with OpenAIServer(model="tiny") as served:  # an engine's card: no draftline facts
        facts = pf.Facts()
        assert pf.check_inference(settings_for(tmp_path, inference_url=served.url), spec, facts).ok
    refused = pf.check_layer_ids(settings_for(tmp_path, model_dir=target), spec, facts)
    assert not refused.ok and refused.severity == pf.ERROR and "the target's 61 layers" in refused.message
    unknown = pf.check_layer_ids(settings_for(tmp_path), spec, facts)
    assert (unknown.ok, unknown.severity) == (False, pf.WARNING) and "DRAFTLINE_MODEL_DIR" in unknown.fix


def test_data_on_tmpfs_is_refused_unless_allowed_or_forced(tmp_path):
    with mounted_tmpfs(tmp_path / "volume", 4 << 20) as fs:
        refused = pf.check_persistent(settings_for(fs.path))
        accepted = pf.check_persistent(settings_for(fs.path, allow_ephemeral_data=True))
        forced = pf.run_preflight(settings_for(fs.path), force=True)
    assert (refused.ok, refused.severity) == (False, pf.ERROR)
    assert "on tmpfs" in refused.message and "DRAFTLINE_ALLOW_EPHEMERAL_DATA=true" in refused.fix
    assert (accepted.ok, accepted.severity) == (False, pf.WARNING)
    assert not forced.ok and forced.allowed and check(forced, "data directory persistent").severity == pf.ERROR


def test_data_under_tmp_is_ephemeral_even_on_a_disk():
    path = Path(tempfile.mkdtemp(dir="/tmp", prefix="draftline-preflight-"))
    try:
        found = pf.check_persistent(settings_for(path / "data"))
    finally:
        shutil.rmtree(path)
    assert not found.ok and "under /tmp" in found.message


def test_a_read_only_data_directory_is_named(tmp_path):
    with mounted_tmpfs(tmp_path / "readonly", 1 << 20, read_only=True) as fs:
        found = pf.check_writable(fs.path)
        nested = pf.check_writable(fs.path / "data")
    for result, where in ((found, fs.path), (nested, fs.path / "data")):
        assert (result.ok, result.severity) == (False, pf.ERROR)
        assert str(where) in result.message and "EROFS" in result.message
        assert "writable" in result.fix


def test_a_run_larger_than_the_volume_warns_and_a_volume_below_its_reserve_refuses(tmp_path):
    rows = [{"prompt": "a question of some length " * 4} for _ in range(200)]
    big = write_jsonl(tmp_path / "big.jsonl", rows)
    spec = spec_for(big, generation=GenerationConfig(max_tokens=64))
    with mounted_tmpfs(tmp_path / "volume", 1 << 20) as fs:
        short = pf.check_disk(settings_for(fs.path), spec, pf.Facts(card=TINY_CARD))
        limited = pf.check_disk(settings_for(fs.path), spec.model_copy(update={"limit": 3}), pf.Facts(card=TINY_CARD))
        full = pf.check_disk(settings_for(fs.path, disk_reserve_bytes=2 << 20), spec, pf.Facts(card=TINY_CARD))
    assert (short.ok, short.severity) == (False, pf.WARNING)
    assert "198 samples" in short.message and "pauses" in short.fix
    assert limited.ok and "1 samples" in limited.message  # limit 3, 2 held out
    assert (full.ok, full.severity) == (False, pf.ERROR)
    assert "less free space than the reserve" in full.message


def test_the_projection_counts_replies_checkpoints_and_the_export_beside_the_hidden_states(tmp_path):
    big = write_jsonl(tmp_path / "big.jsonl", [{"prompt": "q"} for _ in range(6)])
    model_dir = tmp_path / "target"
    model_dir.mkdir()
    target = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 192,
              "vocab_size": 774, "num_hidden_layers": 8, "torch_dtype": "float32"}
    (model_dir / "config.json").write_text(json.dumps(target))
    spec = spec_for(big, train=TrainConfig(draft_vocab_size=128))
    with mounted_tmpfs(tmp_path / "volume", 1 << 20) as fs:
        found = pf.check_disk(settings_for(fs.path, model_dir=model_dir), spec, pf.Facts(card=TINY_CARD))
    # Four samples' hidden states fit in 1 MiB; three checkpoints of ~78k trained parameters at 12 bytes do not.
    training = training_bytes(RunPaths(fs.path, "pre"), target, spec.train)
    assert training > 3 * 12 * 70_000 and f"{format_bytes(training)} of checkpoints and export" in found.message
    assert "of replies" in found.message and (found.ok, found.severity) == (False, pf.WARNING)


@pytest.mark.parametrize("rows", [40, 3000])  # read whole, and extrapolated from the first 4 MiB
def test_a_json_array_datasets_rows_are_its_elements_not_its_lines(tmp_path, rows):
    conversation = {"id": "x", "conversations": [{"from": "human", "value": "a question\nover lines " * 40},
                                                 {"from": "gpt", "value": "an answer\n" * 60}]}
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps([conversation] * rows, indent=2))  # pretty-printed: about 15 lines a row
    assert path.read_text().count("\n") > 10 * rows
    assert (path.stat().st_size > pf.DATASET_SAMPLE_BYTES) == (rows == 3000)
    found = pf.check_disk(settings_for(tmp_path), spec_for(path), pf.Facts(card=TINY_CARD))
    assert found.ok and f"{rows - 2:,} samples" in found.message  # 2 held out


def test_the_projection_of_an_fp8_run_counts_a_byte_a_value_and_its_scales(tmp_path):
    dataset = write_jsonl(tmp_path / "rows.jsonl", [{"prompt": "a question"} for _ in range(10)])
    projected = {}
    for storage in ("target", "fp8"):
        facts = pf.Facts(card=TINY_CARD)
        found = pf.check_disk(settings_for(tmp_path), spec_for(dataset, extraction=ExtractionConfig(storage=storage)), facts)
        projected[storage] = facts.bytes_per_token
        assert found.ok and f"{facts.bytes_per_token:,.0f} bytes" in found.message
    assert projected == {"target": 4 * 64 * 4 + 9, "fp8": 4 * 64 + 4 * 2 + 9}


def test_a_gpu_is_required_only_when_cuda_is_configured(tmp_path):
    assert pf.check_gpu(settings_for(tmp_path, device="auto")).ok
    names, _ = pf.visible_gpus()
    found = pf.check_gpu(settings_for(tmp_path, device="cuda"))
    if names:
        assert found.ok and names[0] in found.message
    elif names is None:
        assert (found.ok, found.severity) == (False, pf.WARNING)
    else:
        assert (found.ok, found.severity) == (False, pf.ERROR)
        assert "no GPU is visible" in found.message and "DRAFTLINE_DEVICE=cpu" in found.fix


# ---- base checkpoints ------------------------------------------------------------------------------


def test_a_base_checkpoint_on_the_volume_verifies(tmp_path, exported_drafter):
    data = tmp_path / "data"
    shutil.copytree(exported_drafter, data / "drafters" / "mine")
    found, relative = pf.check_base_checkpoint(settings_for(data), "drafters/mine", pf.Facts(card=TINY_CARD))
    assert found.ok and relative == "drafters/mine", found.message
    assert "draft vocabulary 64" in found.message


def test_a_base_checkpoint_that_does_not_verify_is_named(tmp_path, exported_drafter):
    data = tmp_path / "data"
    (data / "broken").mkdir(parents=True)
    shutil.copy(exported_drafter / "config.json", data / "broken" / "config.json")
    found, relative = pf.check_base_checkpoint(settings_for(data), "broken", pf.Facts(card=TINY_CARD))
    assert relative is None and not found.ok
    assert "does not verify" in found.message and "model.safetensors" in found.message

    shutil.copytree(exported_drafter, data / "wide")
    other_target = {"id": "big", "draftline": {"hidden_size": 4096, "vocab_size": 774}}
    found, _ = pf.check_base_checkpoint(settings_for(data), "wide", pf.Facts(card=other_target))
    assert not found.ok and "target_hidden_size is 64, the target's hidden_size is 4096" in found.message


def test_a_published_base_checkpoint_verifies_and_says_where_its_draft_vocabulary_comes_from(tmp_path, tiny_model_dir):
    from tests.support.published_drafter import VLLM, Published, write_published_drafter

    data = tmp_path / "data"
    write_published_drafter(data / "drafters" / "kept", tiny_model_dir, Published())
    write_published_drafter(data / "drafters" / "bare", tiny_model_dir, Published(convention=VLLM, mapping=()))
    kept, _ = pf.check_base_checkpoint(settings_for(data), "drafters/kept", pf.Facts(card=TINY_CARD))
    bare, relative = pf.check_base_checkpoint(settings_for(data), "drafters/bare", pf.Facts(card=TINY_CARD))
    assert kept.ok and "its own d2t/t2d" in kept.message, kept.message
    assert bare.ok and relative == "drafters/bare" and "computes the draft vocabulary from the run's data" in bare.message
    assert "layer outputs [1, 3, 4]" in bare.message  # vLLM's [2, 4, 5], read once into our terms


def test_a_base_checkpoint_for_other_layers_or_another_target_is_named(tmp_path, tiny_model_dir, exported_drafter):
    from tests.support.published_drafter import Published, write_published_drafter

    data = tmp_path / "data"
    write_published_drafter(data / "drafters" / "deep", tiny_model_dir, Published(layer_ids=[1, 3, 6]))
    shutil.copytree(exported_drafter, data / "drafters" / "mine")
    shallow = {"id": "tiny", "draftline": {**TINY_CARD["draftline"], "num_layers": 6}}
    other = {"id": "tiny", "draftline": {**TINY_CARD["draftline"], "fingerprint": "f" * 64}}
    deep, _ = pf.check_base_checkpoint(settings_for(data), "drafters/deep", pf.Facts(card=shallow))
    foreign, _ = pf.check_base_checkpoint(settings_for(data), "drafters/mine", pf.Facts(card=other))
    assert not deep.ok and "eagle_config.eagle_aux_hidden_state_layer_ids is [1, 3, 6], the target has num_hidden_layers 6" in deep.message
    assert not foreign.ok and f"draftline.target_fingerprint is {'0' * 64}, the target's fingerprint is {'f' * 64}" in foreign.message


def test_a_base_checkpoint_outside_the_volume_or_nowhere_is_named(tmp_path, exported_drafter):
    data = tmp_path / "data"
    data.mkdir()
    outside, _ = pf.check_base_checkpoint(settings_for(data), str(exported_drafter), pf.Facts())
    assert not outside.ok and "outside the data volume" in outside.message
    nowhere, _ = pf.check_base_checkpoint(settings_for(data), "no/such/dir", pf.Facts())
    assert not nowhere.ok and "not a Hugging Face repo id" in nowhere.message


# ---- the controller's API and the command ----------------------------------------------------------


@pytest.fixture(scope="module")
def controller(tmp_path_factory, redis_server, exported_drafter):
    root = tmp_path_factory.mktemp("preflight-api")
    data = root / "data"
    data.mkdir()
    make_model_hub_cache(root / "hub", HUB_REPO, exported_drafter)
    port = free_port()
    with OpenAIServer(model="served-name") as served:
        env = {"REDIS_URL": redis_server.url, "DRAFTLINE_DATA": str(data), "DRAFTLINE_PORT": str(port),
               "DRAFTLINE_HOST": "127.0.0.1", "DRAFTLINE_INFERENCE_URL": served.url, "DRAFTLINE_FEED_INTERVAL_S": "5",
               "DRAFTLINE_DISK_RESERVE_BYTES": "0", "DRAFTLINE_DISK_RESERVE_FRACTION": "0",
               "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(root / "hub"), "HF_HOME": str(root / "hf-home"),
               "DRAFTLINE_DATASET_ROOTS": str(root)}
        with ServiceProcess("controller", env=env, log_dir=root / "logs", health_url=f"http://127.0.0.1:{port}/health"):
            yield {"url": f"http://127.0.0.1:{port}", "data": data, "root": root}


def post_run(controller, name: str, **extra) -> httpx.Response:
    path = write_jsonl(controller["root"] / f"{name}.jsonl", [{"prompt": f"p{i}"} for i in range(6)])
    body = {"dataset": str(path), "name": name, "evaluate": {"holdout": 1}, **extra}
    return httpx.post(f"{controller['url']}/runs", json=body, timeout=180)


def test_submission_is_refused_with_412_naming_each_failed_check(controller):
    response = post_run(controller, "refused", train={"base_checkpoint": "owner/missing"})
    assert response.status_code == 412, response.text
    detail = response.json()["detail"]
    failed = {c["name"]: c for c in detail["failed"]}
    assert set(failed) == {"data directory persistent", "base checkpoint"}, detail
    assert "cannot be fetched" in failed["base checkpoint"]["message"]
    assert all(c["fix"] for c in failed.values()) and "force" in detail["message"]
    assert not (controller["data"] / "runs" / "refused").exists()

    report = httpx.get(f"{controller['url']}/preflight", timeout=60).json()
    assert report["ok"] is False and [c["name"] for c in report["failed"]] == ["data directory persistent"]


def test_a_forced_run_fetches_its_hub_checkpoint_onto_the_volume_and_records_it(controller):
    from modeling.export import verify_export

    response = post_run(controller, "forced", force=True, train={"base_checkpoint": HUB_REPO})
    assert response.status_code == 201, response.text
    assert response.json()["train"]["base_checkpoint"] == "models/drafters/owner--drafter"
    fetched = controller["data"] / "models" / "drafters" / "owner--drafter"
    assert sorted(p.name for p in fetched.iterdir()) == ["config.json", "model.safetensors"]
    assert not any(p.is_symlink() for p in fetched.iterdir())  # copies on the volume, not links into a cache
    verify_export(fetched)
    assert temp_files(controller["data"] / "models") == []
    assert not [p for p in fetched.parent.iterdir() if p.name.startswith(".tmp-")]


def test_preflight_command_prints_each_check_and_fails_until_forced(tmp_path, monkeypatch, capsys, redis_url, dataset):
    config = tmp_path / "run.json"
    body = {"dataset": str(dataset), "name": "cli", "model": "m", "train": TrainConfig().model_dump()}
    config.write_text(json.dumps(body))
    for name, value in {"REDIS_URL": redis_url, "DRAFTLINE_DATA": str(tmp_path / "data"),
                        "DRAFTLINE_INFERENCE_URL": f"http://127.0.0.1:{free_port()}",
                        "DRAFTLINE_DATASET_ROOTS": str(tmp_path)}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.chdir(tmp_path)
    assert preflight_command.preflight_main(argparse.Namespace(run_config=str(config), force=False, json=False)) == 1
    text = capsys.readouterr().out
    assert "[FAIL] inference server" in text and "fix: start the inference server" in text
    assert "[ok  ] redis" in text
    assert preflight_command.preflight_main(argparse.Namespace(run_config=str(config), force=True, json=True)) == 0
    assert json.loads(capsys.readouterr().out)["forced"] is True
