"""Fixtures shared by the unit tests."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

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


@pytest.fixture
def core() -> Any:
    """The shim's C core through :mod:`kvgpu.shimcore` (a real region, the shim's own code);
    skips the test where it cannot be built (no compiler or shim sources)."""
    from kvgpu import shimcore

    try:
        return shimcore.core()
    except Exception as e:  # no compiler / shim sources here
        pytest.skip(f"shim core unavailable: {e}")
