"""Fixtures shared by the unit tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.unit.extender_helpers import Harness


@pytest.fixture
def harness(monkeypatch: pytest.MonkeyPatch) -> Iterator[Harness]:
    """The extender's app over HTTP on a fake state and API (tests.unit.extender_helpers)."""
    h = Harness(monkeypatch)
    try:
        yield h
    finally:
        h.close()
