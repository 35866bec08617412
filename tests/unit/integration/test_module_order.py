"""The order the xdist workers take the suite's modules in (tests/conftest.py): longest first by the seconds
recorded in tests/module_seconds.json, a slow module not recorded yet among the long ones, the tests of a
module in their own order (several integration modules run their tests as one chain)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from tests.conftest import MODULE_SECONDS, UNRECORDED_SLOW_S, module_order

REPO = Path(__file__).resolve().parents[3]


@dataclass
class Item:
    nodeid: str
    markers: set[str] = field(default_factory=set)

    def get_closest_marker(self, name: str) -> str | None:
        return name if name in self.markers else None


def test_modules_go_longest_first_and_keep_their_tests_in_order() -> None:
    items = [
        Item("tests/unit/test_a.py::test_1"),
        Item("tests/integration/test_short.py::test_1", {"slow"}),
        Item("tests/integration/test_long.py::test_first", {"slow"}),
        Item("tests/integration/test_new.py::test_1", {"slow"}),
        Item("tests/integration/test_long.py::test_second", {"slow"}),
        Item("tests/unit/test_b.py::test_1"),
    ]
    recorded = {"tests/integration/test_long.py": UNRECORDED_SLOW_S + 1, "tests/integration/test_short.py": 20}

    ordered = [item.nodeid for item in module_order(items, recorded)]  # type: ignore[arg-type]

    assert ordered == [
        "tests/integration/test_long.py::test_first",
        "tests/integration/test_long.py::test_second",
        "tests/integration/test_new.py::test_1",  # not recorded yet: scheduled as a long one, not last
        "tests/integration/test_short.py::test_1",
        "tests/unit/test_a.py::test_1",  # unrecorded fast modules keep the collection's order
        "tests/unit/test_b.py::test_1",
    ]


def test_every_recorded_module_exists() -> None:
    """A renamed module would lose its place silently: its old name stays in the file, its new one is unknown."""
    recorded = json.loads(MODULE_SECONDS.read_text())
    assert [module for module in recorded if not (REPO / module).is_file()] == []
