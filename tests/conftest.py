"""Suite-wide options: ``--run-slow`` also runs the long soaks (tests marked ``slow``).

CI (``make test``, 2 cores) stays under ~20 minutes by leaving them out; each slow test has
a sibling that CI runs on the same mechanism (named in its docstring or its mark's comment):
the slow one widens it (more phases, layouts, levels or kill schedules).
"""

from __future__ import annotations

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--run-slow",
        action="store_true",
        default=False,
        help="also run the long soaks (marked slow)",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--run-slow"):
        return
    skip = pytest.mark.skip(reason="long soak: run with --run-slow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
