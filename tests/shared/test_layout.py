
import pytest

from shared.errors import PathOutsideVolume
from shared.layout import RunPaths, check_run_name, resolve_inside, shard_name


def test_shards_hold_2000_consecutive_ids():
    assert shard_name(0) == "rows_000000-001999"
    assert shard_name(1999) == "rows_000000-001999"
    assert shard_name(2000) == "rows_002000-003999"
    assert shard_name(1_400_123) == "rows_1400000-1401999"


def test_sample_paths_are_sharded_by_id(tmp_path):
    paths = RunPaths(tmp_path, "r1")
    assert paths.hidden(2001) == tmp_path / "runs/r1/hidden_states/rows_002000-003999/00002001.safetensors"
    assert paths.hidden_relative(5) == "runs/r1/hidden_states/rows_000000-001999/00000005.safetensors"
    assert paths.failure("extract", 7).name == "00000007.json"


@pytest.mark.parametrize("candidate", ["/etc/passwd", "../outside.safetensors", "runs/../../x", "/tmp"])
def test_paths_outside_the_volume_are_refused(tmp_path, candidate):
    with pytest.raises(PathOutsideVolume):
        resolve_inside(tmp_path / "vol", candidate)


def test_paths_inside_the_volume_resolve(tmp_path):
    root = tmp_path / "vol"
    assert resolve_inside(root, "runs/a/b.safetensors") == (root / "runs/a/b.safetensors").resolve()
    assert resolve_inside(root, root / "x") == (root / "x").resolve()


def test_symlink_escaping_the_volume_is_refused(tmp_path):
    root = tmp_path / "vol"
    root.mkdir()
    (root / "link").symlink_to(tmp_path)
    with pytest.raises(PathOutsideVolume):
        resolve_inside(root, "link/escape.safetensors")


@pytest.mark.parametrize("name", ["", "../x", "a/b", "-x", "a b", "x" * 101, "a..b"])
def test_bad_run_names_are_refused(name):
    with pytest.raises(ValueError):
        check_run_name(name)


def test_good_run_names_pass():
    assert check_run_name("demo-20261129.1_a") == "demo-20261129.1_a"
