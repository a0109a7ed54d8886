"""The volume identity: created once and never replaced, recorded in Redis, compared by workers."""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from shared.atomic import temp_files
from runtime.volume import (
    IDENTITY_FILE,
    VOLUME_KEY,
    VolumeMismatch,
    claim_volume,
    ensure_identity,
    identity_path,
    keep_claimed,
    read_identity,
    verify_volume,
)


def test_identity_is_created_once_and_then_reused(data_dir):
    first = ensure_identity(data_dir)
    again = ensure_identity(data_dir)
    assert first == again
    assert json.loads((data_dir / IDENTITY_FILE).read_text())["volume_id"] == first.volume_id
    assert temp_files(data_dir) == []


def test_racing_creators_agree_on_one_identity(data_dir):
    with ThreadPoolExecutor(8) as pool:
        ids = {identity.volume_id for identity in pool.map(lambda _: ensure_identity(data_dir), range(32))}
    assert len(ids) == 1
    assert read_identity(data_dir).volume_id in ids
    assert temp_files(data_dir) == []


def test_claim_records_the_identity_in_redis(data_dir, redis_conn):
    identity = claim_volume(data_dir, redis_conn)
    assert redis_conn.get(VOLUME_KEY).decode() == identity.volume_id
    assert verify_volume(data_dir, redis_conn) == identity.volume_id


def test_a_controller_on_another_volume_takes_over_the_record(tmp_path, redis_conn):
    old = claim_volume(tmp_path / "old", redis_conn)
    new = claim_volume(tmp_path / "new", redis_conn)
    assert old.volume_id != new.volume_id
    assert verify_volume(tmp_path / "new", redis_conn) == new.volume_id
    with pytest.raises(VolumeMismatch, match=new.volume_id):
        verify_volume(tmp_path / "old", redis_conn)


def test_a_directory_without_identity_is_refused_naming_the_expected_volume(tmp_path, redis_conn):
    identity = claim_volume(tmp_path / "shared", redis_conn)
    empty = tmp_path / "local"
    empty.mkdir()
    with pytest.raises(VolumeMismatch, match=f"has no {IDENTITY_FILE}.*{identity.volume_id}"):
        verify_volume(empty, redis_conn)
    assert not identity_path(empty).exists()  # a worker never creates an identity of its own


def test_a_directory_reached_through_another_path_is_the_same_volume(tmp_path, redis_conn):
    identity = claim_volume(tmp_path / "export", redis_conn)
    mount = tmp_path / "mnt"
    mount.symlink_to(tmp_path / "export")
    assert verify_volume(mount, redis_conn) == identity.volume_id


def test_a_corrupt_identity_file_is_refused(data_dir, redis_conn):
    claim_volume(data_dir, redis_conn)
    (data_dir / IDENTITY_FILE).write_text("{not json")
    with pytest.raises(VolumeMismatch, match="unreadable volume identity"):
        verify_volume(data_dir, redis_conn)
    with pytest.raises(VolumeMismatch):
        claim_volume(data_dir, redis_conn)  # the controller does not paper over it with a new id


def test_nothing_is_refused_before_any_controller_recorded_a_volume(data_dir, redis_conn):
    assert verify_volume(data_dir, redis_conn) is None


def test_keeper_records_the_identity_again_after_redis_forgets_it(data_dir, redis_conn):
    identity = claim_volume(data_dir, redis_conn)
    stop = threading.Event()
    keeper = threading.Thread(target=keep_claimed, args=(data_dir, redis_conn, stop, 0.05))
    keeper.start()
    try:
        redis_conn.flushall()
        for _ in range(200):
            if redis_conn.get(VOLUME_KEY) is not None:
                break
            stop.wait(0.05)
        assert redis_conn.get(VOLUME_KEY).decode() == identity.volume_id
    finally:
        stop.set()
        keeper.join()
