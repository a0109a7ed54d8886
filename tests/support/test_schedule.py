"""The order modules start in under pytest-xdist: longest first, each module's own order kept, and a record that
a partial run updates without losing the rest."""

from __future__ import annotations

import json
from types import SimpleNamespace

from tests.support.schedule import ModuleSeconds, longest_first, recorded


def items(*nodeids: str) -> list[SimpleNamespace]:
    return [SimpleNamespace(nodeid=nodeid) for nodeid in nodeids]


def test_the_longest_recorded_module_starts_first_and_keeps_its_tests_in_order():
    collected = items("tests/a.py::one", "tests/b.py::one", "tests/a.py::two", "tests/c.py::one", "tests/b.py::two")
    ordered = longest_first(collected, {"tests/a.py": 5.0, "tests/b.py": 80.0})
    assert [i.nodeid for i in ordered] == ["tests/b.py::one", "tests/b.py::two", "tests/a.py::one",
                                           "tests/a.py::two", "tests/c.py::one"]  # c.py unrecorded: last


def test_a_run_records_its_modules_and_keeps_the_figures_of_the_modules_it_did_not_run(tmp_path):
    record = tmp_path / "module_seconds.json"
    record.write_text(json.dumps({"tests/a.py": 5.0, "tests/b.py": 80.0}))
    plugin = ModuleSeconds(SimpleNamespace(), path=record)
    for nodeid, seconds in (("tests/a.py::one", 1.25), ("tests/a.py::two", 2.0), ("tests/d.py::one", 0.5)):
        plugin.pytest_runtest_logreport(SimpleNamespace(nodeid=nodeid, duration=seconds))
    plugin.pytest_sessionfinish(SimpleNamespace())
    assert recorded(record) == {"tests/b.py": 80.0, "tests/a.py": 3.2, "tests/d.py": 0.5}
    assert list(json.loads(record.read_text())) == ["tests/b.py", "tests/a.py", "tests/d.py"]  # longest first


def test_an_unreadable_record_orders_nothing(tmp_path):
    record = tmp_path / "module_seconds.json"
    record.write_text("{torn")
    assert recorded(record) == {} and recorded(tmp_path / "absent.json") == {}
