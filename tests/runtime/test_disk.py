"""Disk headroom: measured and estimated projections, the pause flag, and waiting for space (real Redis,
real volumes; a size-limited tmpfs where the volume must be small)."""

from __future__ import annotations

import json
import logging
import threading

import pytest

from runtime import disk
from runtime.shutdown import JobYielded
from shared.runspec import ExtractionConfig, GenerationConfig, RunSpec
from runtime.runstate import RunState
from shared.lifecycle import Failure, FailureKind
from shared.settings import ControllerSettings
from tests.support.stopping import stop_in  # noqa: F401 - a fixture
from tests.support.tmpfs import mounted_tmpfs

RUN = "disky"
POLL = 61.5  # a poll interval no other caller of time.sleep uses


def make_run(data, conn, *, expected: int = 10, prompts_bytes: int = 4000, max_tokens: int = 100,
             max_length: int = 4096) -> RunState:
    spec = RunSpec(name=RUN, dataset="d.jsonl", model="m", rows=expected, train_ids=expected,
                   generation=GenerationConfig(max_tokens=max_tokens),
                   extraction=ExtractionConfig(max_length=max_length))
    spec.save(data)
    state = RunState(conn, data, RUN)
    state.register(expected, state="generating", prompts_bytes=prompts_bytes, hidden_bytes=0)
    return state


def land(state: RunState, sample_id: int, nbytes: int, tokens: int) -> None:
    state.mark_done("extract", sample_id, landed=disk.landed_counts(nbytes, tokens))


def settings_for(data, reserve: int = 0) -> ControllerSettings:
    return ControllerSettings(data=data, disk_reserve_bytes=reserve, disk_reserve_fraction=0.0)


def test_landed_samples_give_the_measured_projection(data_dir, redis_conn):
    state = make_run(data_dir, redis_conn, expected=10)
    for sample_id, (nbytes, tokens) in enumerate([(1000, 10), (3000, 30), (2000, 20), (4000, 40)]):
        land(state, sample_id, nbytes, tokens)
    state.mark_failed(Failure(run=RUN, stage="generate", sample_id=9, error_class="X", message="bad row"))
    state.mark_failed(Failure(run=RUN, stage="generate", sample_id=8, error_class="Y", message="short", kind=FailureKind.DROPPED))
    meta = state.meta()
    assert (float(meta["hidden_bytes"]), float(meta["hidden_tokens"])) == (10000, 100)

    headroom = disk.assess(RunState(redis_conn, data_dir, RUN))
    assert headroom.measured and headroom.ok
    assert headroom.bytes_per_token == 100.0  # 10000 bytes / 100 tokens
    assert headroom.remaining_samples == 4  # 10 expected, 4 extracted, 1 failed and 1 dropped in generation
    assert headroom.hidden_bytes == 4 * 25 * 100  # 25 tokens per sample so far
    # No reply landed yet: 10 expected less 2 settled in generation, each 2 x 400 prompt bytes + 12 x 100 tokens.
    assert headroom.replies_bytes == 8 * (2 * 400 + 12 * 100) and headroom.training_bytes == 0  # no target config
    assert headroom.projected_bytes == headroom.hidden_bytes + headroom.replies_bytes
    assert "measured" in headroom.message and "of replies" in headroom.message


def test_before_any_sample_lands_the_stated_rule_estimates(data_dir, redis_conn):
    make_run(data_dir, redis_conn, expected=10, prompts_bytes=4000, max_tokens=100)
    headroom = disk.assess(RunState(redis_conn, data_dir, RUN), bytes_per_token_hint=513)
    # 400 prompt bytes per row / 4 bytes per token + 100 reply tokens = 200 tokens per sample
    assert disk.estimate_sample_tokens(400, 100, 4096) == 200
    assert disk.estimate_sample_tokens(400, 100, 150) == 150  # extraction.max_length caps a sample
    assert headroom.hidden_bytes == 10 * 200 * 513 and not headroom.measured
    assert "estimated" in headroom.message

    # an estimate recorded at submission wins over the hint
    RunState(redis_conn, data_dir, RUN).set_meta(**{disk.BYTES_PER_TOKEN_ESTIMATE: 1000})
    assert disk.assess(RunState(redis_conn, data_dir, RUN), bytes_per_token_hint=513).hidden_bytes == 10 * 200 * 1000


def test_without_any_size_per_token_nothing_is_projected(data_dir, redis_conn):
    make_run(data_dir, redis_conn)
    headroom = disk.assess(RunState(redis_conn, data_dir, RUN))
    assert (headroom.hidden_bytes, headroom.bytes_per_token, headroom.ok) == (0, None, True)
    assert "no size per token known yet" in headroom.message


def test_bytes_per_token_of_a_target_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 4096, "torch_dtype": "bfloat16"}))
    assert disk.target_bytes_per_token(tmp_path) == 4 * 4096 * 2 + 9
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"hidden_size": 64}, "dtype": "float32"}))
    assert disk.target_bytes_per_token(tmp_path) == 4 * 64 * 4 + 9
    assert disk.target_bytes_per_token(tmp_path / "missing") is None


def test_fp8_storage_costs_a_byte_a_value_and_four_bf16_scales_a_token_whatever_the_targets_dtype(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 4096, "torch_dtype": "bfloat16"}))
    assert disk.target_bytes_per_token(tmp_path, "fp8") == 4 * 4096 + 4 * 2 + 9
    assert disk.hidden_bytes_per_token(64, "float32", "fp8") == 4 * 64 + 8 + 9


def test_a_volume_not_yet_created_is_measured_where_it_would_live(tmp_path):
    assert disk.volume_usage(tmp_path / "not" / "yet") == disk.volume_usage(tmp_path)


def test_supervision_pauses_a_run_that_does_not_fit_and_resumes_it_when_the_volume_grows(tmp_path, redis_conn):
    with mounted_tmpfs(tmp_path / "volume", 1 << 20) as fs:
        state = make_run(fs.path, redis_conn, expected=100)
        land(state, 0, 100_000, 1000)  # 99 more samples of 100 KB: ~9.9 MB on a 1 MiB volume
        settings = settings_for(fs.path)

        headroom = disk.supervise_disk(settings, RunState(redis_conn, settings.data, RUN))
        assert not headroom.ok and headroom.hidden_bytes == 99 * 1000 * 100
        reason = disk.paused_reason(redis_conn, RUN)
        assert reason and str(fs.path) in reason and "short by" in reason
        status = disk.disk_status(redis_conn, RUN)
        assert status["paused"] and status["reason"] == reason
        assert disk.format_disk_pause(status) == (f"  PAUSED    new prompts held back and extraction waits for disk "
                                                  f"space: {reason}")
        assert status["holds"] == ["generate", "extract"]
        assert (status["projected_bytes"], status["bytes_per_token"]) == (headroom.projected_bytes, 100.0)
        assert status["checked_free_bytes"] == headroom.free_bytes and status["reserve_bytes"] == headroom.reserve_bytes

        # Still short: it stays paused, and the first pause time is kept.
        disk.supervise_disk(settings, RunState(redis_conn, settings.data, RUN))
        assert disk.disk_status(redis_conn, RUN)["paused_at"] == status["paused_at"]

        fs.resize(16 << 20)
        assert disk.supervise_disk(settings, RunState(redis_conn, settings.data, RUN)).ok
        assert disk.paused_reason(redis_conn, RUN) is None
        assert disk.disk_status(redis_conn, RUN)["paused"] is False
        assert disk.format_disk_pause(disk.disk_status(redis_conn, RUN)) is None


def test_free_space_below_the_reserve_pauses_even_a_finished_projection(data_dir, redis_conn):
    make_run(data_dir, redis_conn, expected=1)
    free, _ = disk.volume_usage(data_dir)
    headroom = disk.supervise_disk(settings_for(data_dir, reserve=free + (1 << 40)), RunState(redis_conn, data_dir, RUN))
    assert not headroom.ok
    assert "less than the" in disk.paused_reason(redis_conn, RUN)
    disk.supervise_disk(settings_for(data_dir, reserve=0), RunState(redis_conn, data_dir, RUN))
    assert disk.paused_reason(redis_conn, RUN) is None


def test_an_unpaused_run_never_waits(data_dir, redis_conn, caplog, monkeypatch):
    make_run(data_dir, redis_conn)
    polls = []
    real_sleep = disk.time.sleep
    monkeypatch.setattr(disk.time, "sleep", lambda s: polls.append(s) if s == POLL else real_sleep(s))
    # With timeout_s=0 one pass of the wait loop logs and raises DiskPaused: returning proves none ran.
    with caplog.at_level(logging.INFO, logger="runtime.disk"):
        assert disk.wait_for_headroom(redis_conn, data_dir, RUN, poll_s=POLL, timeout_s=0) is None
    assert caplog.records == [] and polls == []
    disk.set_paused(redis_conn, RUN, "volume full")
    with pytest.raises(disk.DiskPaused, match="volume full"):  # the same call waits once the run is paused
        disk.wait_for_headroom(redis_conn, data_dir, RUN, poll_s=POLL, timeout_s=0)


def test_a_paused_extraction_waits_until_the_pause_clears(data_dir, redis_conn, caplog):
    make_run(data_dir, redis_conn)
    disk.set_paused(redis_conn, RUN, "volume full for the test")
    waiting = threading.Event()
    clearer = threading.Thread(target=lambda: (waiting.wait(10), disk.clear_paused(redis_conn, RUN)))
    clearer.start()

    class Signal(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "waits for disk space" in record.getMessage():
                waiting.set()

    handler = Signal()
    logging.getLogger("runtime.disk").addHandler(handler)
    try:
        with caplog.at_level(logging.INFO, logger="runtime.disk"):
            disk.wait_for_headroom(redis_conn, data_dir, RUN, poll_s=0.05)
    finally:
        logging.getLogger("runtime.disk").removeHandler(handler)
        clearer.join()
    assert "volume full for the test" in caplog.text
    assert "disk space is back" in caplog.text


def test_a_paused_extraction_yields_once_the_worker_is_told_to_stop(data_dir, redis_conn, stop_in):
    make_run(data_dir, redis_conn)
    disk.set_paused(redis_conn, RUN, "volume full for the test")
    stop_in(0.2)
    with pytest.raises(JobYielded, match=f"waiting for disk space for run {RUN}'s extraction"):
        disk.wait_for_headroom(redis_conn, data_dir, RUN, poll_s=30.0)
    assert disk.paused_reason(redis_conn, RUN) == "volume full for the test"  # the pause is the supervisor's to lift


def test_a_wait_with_a_limit_ends_with_a_named_error(data_dir, redis_conn):
    make_run(data_dir, redis_conn)
    disk.set_paused(redis_conn, RUN, "still full")
    with pytest.raises(disk.DiskPaused, match="still full"):
        disk.wait_for_headroom(redis_conn, data_dir, RUN, poll_s=0.01, timeout_s=0.05)


def test_an_estimate_alone_never_pauses_a_run(tmp_path, redis_conn):
    with mounted_tmpfs(tmp_path / "volume", 1 << 20) as fs:
        make_run(fs.path, redis_conn, expected=1000, max_tokens=512)
        RunState(redis_conn, fs.path, RUN).set_meta(**{disk.BYTES_PER_TOKEN_ESTIMATE: 1033})
        headroom = disk.supervise_disk(settings_for(fs.path), RunState(redis_conn, fs.path, RUN))
    assert headroom.ok and not headroom.measured and headroom.projected_bytes > (1 << 20)
    assert "the estimate is short by" in headroom.message
    assert disk.paused_reason(redis_conn, RUN) is None
