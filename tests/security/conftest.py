"""Boundary tests: each tries, as a hostile tenant or an over-reaching user would, to cross one
of kvgpu's boundaries (claim, region, schedule, extender, webhook, device plugin) and asserts it
fails. Real-node tests use the session's real node (``real_node``, ``real_pods``: registered by
tests/conftest.py); the rest run on the session's real control plane."""

from __future__ import annotations

import os

import pytest
from realnode.fixtures import RealPods

__all__ = ["RealPods"]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/security/" in str(item.fspath).replace(os.sep, "/"):
            item.add_marker(pytest.mark.cluster)
