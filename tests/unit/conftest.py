"""Fixtures shared by the unit tests."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
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


@dataclass
class SimAgent:
    """``make(**AgentConfig fields)``: the agent of a one-card simulated node ``gpu-0`` (regions
    under the test's tmp dir, no API server); the pod Events it posts land in ``posted`` as
    (namespace, pod, uid, reason, type, message)."""

    make: Callable[..., Any]
    posted: list[tuple[str, ...]] = field(default_factory=list)


@pytest.fixture
def sim_agent(tmp_path: Path) -> SimAgent:
    from kvgpu.agent.main import Agent, AgentConfig

    sim = tmp_path / "sim.json"
    sim.write_text(json.dumps({"nodes": [{"name": "gpu-0", "cards": [{"count": 1}]}]}))
    out = SimAgent(make=lambda **kw: None)

    class Api:
        async def pod_event(self, namespace, pod, uid, reason, message, type_="Warning"):  # type: ignore[no-untyped-def]
            out.posted.append((namespace, pod, uid, reason, type_, message))

    out.make = lambda **kw: Agent(AgentConfig(node="gpu-0", simulated=str(sim), region_root=str(tmp_path), **kw),
                                  Api())  # type: ignore[arg-type]
    return out
