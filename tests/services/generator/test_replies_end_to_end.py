"""Several replies per prompt (``generation.replies``) through the real services: controller (reads, feeds and
reports), the built-in inference server on the tiny target, generator and extractor workers.

Four runs share the stack: ``one`` (one reply per prompt), ``three`` (three of the same rows: the greedy one and two
sampled), ``again`` (``three`` once more, the same seed) and ``chat`` (two replies to two-turn conversations, every
turn regenerated). The generator asks one request at a time, so the server decodes each alone and a rerun computes
exactly what the first run did.
"""

from __future__ import annotations

import json
import time

import httpx
import pytest

from shared.hidden_file import verify_hidden_file
from shared.layout import RunPaths
from shared.manifest import MANIFEST_NAME, read_manifest
from shared.runspec import RunSpec
from tests.services.controller.api.test_api import controller_env
from tests.services.controller.runs.test_datasets import write_jsonl
from tests.support.processes import ServiceProcess, free_port

PROMPTS = [{"prompt": f"Tell me something about the number {i}."} for i in range(6)]
HELD_OUT = [{"prompt": "Which colour is the sky?"}, {"prompt": "Name a river."}]
CHATS = [{"conversations": [{"from": "human", "value": f"Say a word about {topic}."},
                            {"from": "gpt", "value": "Another model's answer."},
                            {"from": "human", "value": "And one more?"}]} for topic in ("rain", "stone")]
TRAINED, SAMPLED = len(PROMPTS), {"reply_temperature": 1.5, "reply_top_p": 1.0}
GENERATION = {"max_tokens": 8, "min_completion_tokens": 0, "temperature": 0, "seed": 7}
LAYERS = [1, 3, 4]  # the tiny target's default auxiliary layers

pytestmark = pytest.mark.slow


def wait_settled(url: str, runs: list[str], services: list[ServiceProcess], timeout: float = 420.0) -> dict[str, dict]:
    """Each run's status once every expected sample has settled in both stages."""
    deadline, statuses = time.monotonic() + timeout, {}
    while time.monotonic() < deadline:
        for service in services:
            assert service.alive(), f"{service.name} exited:\n{service.log()}"
        statuses = {run: httpx.get(f"{url}/runs/{run}", timeout=30).json() for run in runs}
        if all(s["stages"]["generate"]["remaining"] == s["stages"]["extract"]["remaining"] == 0
               for s in statuses.values()):
            return statuses
        time.sleep(0.5)
    raise AssertionError(f"runs did not settle: {statuses}\n" + "\n".join(s.log()[-3000:] for s in services))


def submit(url: str, dataset, name: str, holdout: int, **generation) -> None:
    body = {"dataset": str(dataset), "name": name, "model": "tiny", "generation": {**GENERATION, **generation},
            "extraction": {"max_length": 256}, "evaluate": {"holdout": holdout}}
    response = httpx.post(f"{url}/runs", json=body, timeout=120)
    assert response.status_code == 201, response.text


@pytest.fixture(scope="module")
def stack(tmp_path_factory, redis_server, tiny_model_dir):
    import redis

    root = tmp_path_factory.mktemp("replies")
    data, logs = root / "data", root / "logs"
    data.mkdir()
    redis.Redis.from_url(redis_server.url).flushall()
    inference_port, controller_port = free_port(), free_port()
    inference_url = f"http://127.0.0.1:{inference_port}"
    common = {"REDIS_URL": redis_server.url, "DRAFTLINE_DATA": str(data), "DRAFTLINE_MODEL_DIR": str(tiny_model_dir),
              "DRAFTLINE_DEVICE": "cpu"}
    services = [
        ServiceProcess("inference", env={**common, "DRAFTLINE_HOST": "127.0.0.1", "DRAFTLINE_PORT": str(inference_port),
                                         "DRAFTLINE_BATCH_WAIT_MS": "0"}, log_dir=logs, health_url=inference_url + "/health"),
        ServiceProcess("controller", env={**common, **controller_env(data, redis_server.url, controller_port, inference_url)},
                       log_dir=logs, health_url=f"http://127.0.0.1:{controller_port}/health"),
        ServiceProcess("generator", env={**common, "DRAFTLINE_INFERENCE_URL": inference_url, "DRAFTLINE_CONCURRENCY": "1"},
                       log_dir=logs),
        ServiceProcess("extractor", env={**common, "DRAFTLINE_HIDDEN_STATES_URL": inference_url}, log_dir=logs),
    ]
    try:
        for service in services:
            service.start()
        yield {"url": f"http://127.0.0.1:{controller_port}", "root": root, "data": data, "services": services}
    finally:
        for service in reversed(services):
            service.stop()


@pytest.fixture(scope="module")
def settled(stack):
    url, root = stack["url"], stack["root"]
    prompts = write_jsonl(root / "prompts.jsonl", PROMPTS + HELD_OUT)
    chats = write_jsonl(root / "chats.jsonl", CHATS + HELD_OUT[:1])
    submit(url, prompts, "one", 2)
    submit(url, prompts, "three", 2, replies=3, **SAMPLED)
    submit(url, prompts, "again", 2, replies=3, **SAMPLED)
    submit(url, chats, "chat", 1, replies=2, **SAMPLED)
    statuses = wait_settled(url, ["one", "three", "again", "chat"], stack["services"])
    return {**stack, "statuses": statuses}


def record(settled, run: str, sample_id: int) -> dict:
    return json.loads(RunPaths(settled["data"], run).generated(sample_id).read_text())


def test_each_training_prompt_ends_with_three_samples_each_with_its_own_verified_files(settled):
    paths, spec = RunPaths(settled["data"], "three"), RunSpec.load(settled["data"], "three")
    assert (spec.train_ids, spec.prompt_rows) == (3 * TRAINED, TRAINED)
    manifest = read_manifest(paths.hidden(0).parent / MANIFEST_NAME)
    for sample_id in range(3 * TRAINED):
        row, reply = spec.reply_of(sample_id)
        assert (row, reply) == (sample_id % TRAINED, sample_id // TRAINED)
        found = record(settled, "three", sample_id)
        assert found["sample_id"] == sample_id and found["messages"] == [{"role": "user", "content": PROMPTS[row]["prompt"]}]
        assert found.get("sampled", {}).get("reply", 0) == reply
        info = verify_hidden_file(paths.hidden(sample_id), layer_ids=LAYERS)
        assert (manifest[sample_id].sha256, manifest[sample_id].num_tokens) == (info.sha256, info.num_tokens)
    assert sorted(manifest) == list(range(3 * TRAINED))


def test_the_first_reply_of_each_prompt_is_the_one_reply_runs_and_the_sampled_ones_differ(settled):
    for sample_id in range(TRAINED):
        one, three = record(settled, "one", sample_id), record(settled, "three", sample_id)
        assert (three["reply"], three["token_ids"]) == (one["reply"], one["token_ids"]) and "sampled" not in three
    sampled = [record(settled, "three", i) for i in range(TRAINED, 3 * TRAINED)]
    assert {(s["sampled"]["temperature"], s["sampled"]["seed"] - s["sample_id"]) for s in sampled} == {(1.5, 7)}
    greedy = {i: record(settled, "three", i)["token_ids"]["reply"] for i in range(TRAINED)}
    differ = [s["sample_id"] for s in sampled if s["token_ids"]["reply"] != greedy[s["sampled"]["row"]]]
    assert len(differ) >= TRAINED, differ  # at temperature 1.5 most of the twelve part from the greedy path


def test_a_rerun_with_the_same_seed_gets_the_same_replies(settled):
    for sample_id in range(3 * TRAINED):
        first, rerun = record(settled, "three", sample_id), record(settled, "again", sample_id)
        assert (rerun["reply"], rerun["token_ids"]) == (first["reply"], first["token_ids"]), sample_id


def test_held_out_rows_get_no_reply_and_are_the_one_reply_runs(settled):
    one, three = RunPaths(settled["data"], "one"), RunPaths(settled["data"], "three")
    held_one = [json.loads(line) for line in one.eval_prompts.read_text().splitlines()]
    held_three = [json.loads(line) for line in three.eval_prompts.read_text().splitlines()]
    assert [h["messages"] for h in held_three] == [h["messages"] for h in held_one]
    assert [h["sample_id"] for h in held_one] == [6, 7] and [h["sample_id"] for h in held_three] == [18, 19]
    assert sorted(p.stem for p in three.generated_dir.rglob("*.json")) == [f"{i:08d}" for i in range(3 * TRAINED)]
    assert not any(three.hidden(h["sample_id"]).exists() for h in held_three)


def test_status_counts_every_sample(settled):
    one, three = settled["statuses"]["one"], settled["statuses"]["three"]
    assert one["expected"] == TRAINED and three["expected"] == 3 * TRAINED
    for stage in ("generate", "extract"):
        shown = three["stages"][stage]
        assert (shown["total"], shown["done"], shown["failed"], shown["dropped"]) == (3 * TRAINED, 3 * TRAINED, 0, 0)
    assert three["stages"]["generate"]["requests"] == 3 * TRAINED and three["failures"] == []
    paths = RunPaths(settled["data"], "three")
    assert three["disk"]["run_bytes"] == sum(p.stat().st_size for p in paths.hidden_dir.rglob("*.safetensors"))


def test_a_sampled_conversation_writes_every_turn_by_sampling_after_its_own_first_reply(settled):
    status = settled["statuses"]["chat"]
    assert status["expected"] == 4 and status["stages"]["extract"]["done"] == 4
    assert status["stages"]["generate"]["requests"] == 8  # two turns for each of the four samples
    for sample_id in range(4):
        found = record(settled, "chat", sample_id)
        first, second = found["turns"]
        earlier = second["messages"][1]  # the sample's own first reply (its reasoning too, where it thought)
        assert (earlier["role"], earlier["content"]) == ("assistant", first["reply"]["content"])
        assert second["messages"][2] == {"role": "user", "content": "And one more?"}
        assert ("sampled" in found) == (sample_id >= 2)
    assert RunPaths(settled["data"], "chat").hidden(3).is_file()


def test_replies_above_one_at_temperature_zero_are_refused_by_name(stack):
    body = {"dataset": str(stack["root"] / "prompts.jsonl"), "name": "refused", "model": "tiny",
            "generation": {"replies": 2, "reply_temperature": 0}}
    response = httpx.post(f"{stack['url']}/runs", json=body, timeout=60)
    assert response.status_code == 422 and "reply_temperature 0" in response.text, response.text
    assert not RunPaths(stack["data"], "refused").root.exists()
