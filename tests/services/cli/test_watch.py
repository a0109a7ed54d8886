"""``draftline status --watch``: progress bars redrawn until the run ends."""

from __future__ import annotations

import io
import os
import subprocess
import sys

from services.cli.watch import bar, render, watch
from runtime.runstate import write_finished
from services.controller.runs.status import run_status
from tests.services.controller.volume import finish_samples, prompt_rows, submit
from tests.support.processes import REPO


def test_bars_fill_in_proportion():
    assert bar(0, 10, width=10) == "[..........]"
    assert bar(5, 10, width=10) == "[#####.....]"
    assert bar(10, 10, width=10) == "[##########]"
    assert bar(3, 0, width=4) == "[....]"  # a stage with nothing to do yet


def test_watch_redraws_until_the_run_finishes(data_dir, redis_conn, tmp_path):
    state = submit(data_dir, redis_conn, tmp_path, "w", prompt_rows(6))
    frames = []

    def fetch() -> dict:
        # Each redraw sees one more sample land; the third one finds the run finished.
        finish_samples(state, generated=range(len(frames) + 1), extracted=range(len(frames)))
        if len(frames) == 2:
            write_finished(state, "failed")
        frames.append(run_status(data_dir, redis_conn, "w"))
        return frames[-1]

    out = io.StringIO()
    last = watch(fetch, interval_s=0.01, out=out, clear=True)
    assert last["state"] == "failed" and len(frames) == 3
    assert out.getvalue().count("\x1b[H\x1b[2J") == 3
    assert "generate  [" in render(frames[0]) and "extract   [" in render(frames[0])


def test_the_cli_watches_a_finished_run_once_and_exits(data_dir, redis_conn, redis_url, tmp_path):
    state = submit(data_dir, redis_conn, tmp_path, "done", prompt_rows(4))
    write_finished(state, "failed")
    env = {**os.environ, "REDIS_URL": redis_url, "DRAFTLINE_DATA": str(data_dir)}
    result = subprocess.run([sys.executable, "-m", "services.cli.main", "status", "done", "--watch", "--interval", "0.1"],
                            cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("generate  [") == 1 and "run done: failed" in result.stdout
