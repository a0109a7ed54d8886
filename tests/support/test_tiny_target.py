"""The tiny target's cache: built once per key, never used torn or changed, safe under concurrent runs.

The builder is the real ``make_tiny_model`` without its teaching steps, so an entry is a real target
directory built in a second instead of the half minute (or, on a loaded machine, ten) of a full build.
"""

from __future__ import annotations

import threading
from functools import partial
from pathlib import Path

import pytest

from services.cli import tiny_model
from shared.atomic import TEMP_PREFIX
from tests.support import tiny_target
from tests.support.tiny_target import (
    TinyTargetCacheError,
    cached_tiny_model,
    entry_for,
    verify_unchanged,
)


@pytest.fixture()
def builds(monkeypatch) -> list[Path]:
    """Every directory the cache built, in order."""
    built: list[Path] = []
    quick = partial(tiny_model.make_tiny_model, num_layers=1, teach_steps=0)

    def counting(out_dir: Path, **kwargs) -> Path:
        built.append(Path(out_dir))
        return quick(out_dir, **kwargs)

    monkeypatch.setattr(tiny_model, "make_tiny_model", counting)
    return built


def test_the_first_call_builds_and_later_calls_reuse_the_entry(tmp_path, builds):
    first = cached_tiny_model(tmp_path)
    second = cached_tiny_model(tmp_path)
    assert first == second == entry_for(tmp_path) / "tiny" and len(builds) == 1
    assert tiny_model.is_model_dir(first)
    assert first.name == "tiny"  # the served model name the tests expect
    assert not builds[0].exists()  # built under a temp name, then renamed into place
    assert not list(tmp_path.glob(TEMP_PREFIX + "*"))


def test_a_changed_file_in_the_entry_is_rebuilt_not_used(tmp_path, builds):
    model_dir = cached_tiny_model(tmp_path)
    (model_dir / "config.json").write_text("{}")
    rebuilt = cached_tiny_model(tmp_path)
    assert len(builds) == 2 and '"hidden_size"' in (rebuilt / "config.json").read_text()


def test_an_entry_without_its_manifest_is_rebuilt(tmp_path, builds):
    model_dir = cached_tiny_model(tmp_path)
    (model_dir.parent / tiny_target.MANIFEST).unlink()
    cached_tiny_model(tmp_path)
    assert len(builds) == 2 and (model_dir.parent / tiny_target.MANIFEST).is_file()


def test_a_build_killed_midway_leaves_nothing_that_is_used_and_is_removed_next_time(tmp_path, builds):
    torn = tmp_path / f"{TEMP_PREFIX}{entry_for(tmp_path).name}.deadbeef" / "tiny"
    torn.mkdir(parents=True)
    (torn / "config.json").write_text("{}")
    model_dir = cached_tiny_model(tmp_path)
    assert len(builds) == 1 and model_dir == entry_for(tmp_path) / "tiny"
    assert not torn.parent.exists()


def test_the_key_changes_with_the_code_the_data_and_the_libraries(tmp_path, monkeypatch):
    source = tmp_path / "tiny_model.py"
    source.write_text("one")
    monkeypatch.setattr(tiny_target, "KEY_SOURCES", (source,))
    keys = [tiny_target.cache_key()]
    source.write_text("two")
    keys.append(tiny_target.cache_key())
    real_version = tiny_target.metadata.version
    monkeypatch.setattr(tiny_target.metadata, "version", lambda name: "0.0" if name == "torch" else real_version(name))
    keys.append(tiny_target.cache_key())
    assert len(set(keys)) == 3


def test_the_shipped_key_covers_the_builder_and_its_training_data():
    names = {path.name for path in tiny_target.KEY_SOURCES}
    assert names == {"tiny_model.py", "demo_prompts.jsonl"} and all(p.is_file() for p in tiny_target.KEY_SOURCES)


def test_two_concurrent_callers_build_once_and_get_the_same_directory(tmp_path, builds):
    found: list[Path] = []
    callers = [threading.Thread(target=lambda: found.append(cached_tiny_model(tmp_path))) for _ in range(2)]
    for caller in callers:
        caller.start()
    for caller in callers:
        caller.join(120)
    assert len(builds) == 1 and found == [entry_for(tmp_path) / "tiny"] * 2


def test_a_write_into_the_shared_directory_is_reported(tmp_path, builds):
    model_dir = cached_tiny_model(tmp_path)
    verify_unchanged(model_dir)  # untouched: no error
    (model_dir / "extra.txt").write_text("a test wrote here")
    with pytest.raises(TinyTargetCacheError, match="wrote into the shared tiny target"):
        verify_unchanged(model_dir)
