"""``draftline run --controller URL``: a run submitted through the API, with the token from the environment,
against a real ``draftline serve controller``; each refusal printed as an error that names the fix."""

from __future__ import annotations

import json

import pytest
import redis

from services.cli.main import main
from shared.runspec import RunSpec
from tests.services.controller.api.test_api_auth import TOKEN, start_controller
from tests.services.controller.runs.test_datasets import write_jsonl
from tests.support.openai_server import OpenAIServer


@pytest.fixture(scope="module")
def controller(tmp_path_factory, redis_server):
    root = tmp_path_factory.mktemp("cli-api")
    redis.Redis.from_url(redis_server.url).flushall()
    with OpenAIServer(model="served-name") as served:
        proc, url = start_controller(root, redis_server.url, served.url, DRAFTLINE_API_TOKEN=TOKEN)
        with proc:
            yield {"url": url, "root": root, "data": root / "data"}


@pytest.fixture()
def cli(controller, tmp_path, monkeypatch, capsys):
    """``draftline run --controller`` in this process, from a directory without a .env."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("DRAFTLINE_API_TOKEN", raising=False)

    def run(*args: str, token: str | None = None) -> tuple[int, str, str]:
        if token is not None:
            monkeypatch.setenv("DRAFTLINE_API_TOKEN", token)
        code = main(["run", "--controller", controller["url"], "--model", "served-name", "--holdout", "1", *args])
        out, err = capsys.readouterr()
        return code, out, err

    return run


def dataset(controller, name: str) -> str:
    return str(write_jsonl(controller["root"] / f"{name}.jsonl", [{"prompt": f"{name} {i}"} for i in range(5)]))


def test_without_the_token_the_cli_says_to_set_it(cli, controller):
    code, out, err = cli("--dataset", dataset(controller, "none"), "--name", "none")
    assert code == 2 and out == ""
    assert "needs its API token: set DRAFTLINE_API_TOKEN" in err, err
    assert not (controller["data"] / "runs" / "none").exists()


def test_with_a_wrong_token_the_cli_says_it_is_not_the_controllers(cli, controller):
    code, _, err = cli("--dataset", dataset(controller, "wrong"), "--name", "wrong", token="not-the-token-0123456789")
    assert code == 2
    assert "refused the API token: DRAFTLINE_API_TOKEN is not the controller's token" in err, err
    assert "not-the-token" not in err


def test_with_the_token_the_run_is_submitted(cli, controller):
    code, out, _ = cli("--dataset", dataset(controller, "right"), "--name", "right", "--max-tokens", "5",
                       "--hidden-storage", "fp8", token=TOKEN)
    assert code == 0
    assert "run right: 5 rows read, 4 sample ids queued for generation" in out
    spec = RunSpec.load(controller["data"], "right")
    assert (spec.generation.max_tokens, spec.extraction.storage) == (5, "fp8")


def test_a_dataset_outside_the_roots_is_an_error_naming_them(cli, controller, tmp_path):
    outside = write_jsonl(tmp_path / "outside.jsonl", [{"prompt": "x"}, {"prompt": "y"}])
    code, _, err = cli("--dataset", str(outside), "--name", "outside", token=TOKEN)
    assert code == 2
    assert "answered 403" in err and "outside the dataset roots" in err, err


def test_a_failed_preflight_lists_each_failed_check_with_its_fix(cli, controller):
    code, out, err = cli("--dataset", dataset(controller, "pre"), "--name", "pre", "--base-checkpoint", "owner/missing",
                         token=TOKEN)
    assert code == 1 and out == ""
    assert "preflight failed" in err and "[FAIL] base checkpoint" in err and "fix:" in err, err


def test_a_run_config_file_sets_every_section_and_the_flags_override_it(cli, controller, tmp_path):
    config = tmp_path / "run.json"
    config.write_text(json.dumps({"generation": {"max_tokens": 7, "temperature": 0.5},
                                  "train": {"epochs": 2, "ttt_steps": 3},
                                  "evaluate": {"humaneval_limit": 2, "max_new_tokens": 9}}))
    code, out, err = cli("--dataset", dataset(controller, "config"), "--name", "config", "--run-config", str(config),
                         "--max-tokens", "11", token=TOKEN)
    assert code == 0, err
    spec = RunSpec.load(controller["data"], "config")
    assert (spec.generation.max_tokens, spec.generation.temperature) == (11, 0.5)  # the flag over the file
    assert (spec.train.epochs, spec.train.ttt_steps) == (2, 3)
    # --holdout 1 (the fixture's flag) joins the file's evaluate section instead of replacing it.
    assert (spec.evaluate.humaneval_limit, spec.evaluate.max_new_tokens, spec.evaluate.holdout) == (2, 9, 1)


@pytest.mark.parametrize(("content", "message"), [
    ("{not json", "run config"),
    ('["generation"]', "a JSON object of sections is needed, not list"),
    ('{"generaton": {}}', "unknown section(s) generaton; it may hold generation, extraction, train, evaluate"),
    ('{"train": 3}', "section(s) train must be JSON objects"),
])
def test_a_run_config_file_that_is_not_sections_is_refused_by_name(cli, controller, tmp_path, content, message):
    config = tmp_path / "run.json"
    config.write_text(content)
    code, out, err = cli("--dataset", dataset(controller, "bad"), "--name", "badconfig", "--run-config", str(config),
                         token=TOKEN)
    assert code == 2 and out == ""
    assert "RunConfigError" in err and message in err and str(config) in err, err
    assert not (controller["data"] / "runs" / "badconfig").exists()
