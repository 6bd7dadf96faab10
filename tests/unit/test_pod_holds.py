"""When a removed claim's pod still holds its cards (then the operator restores the claim)."""

from __future__ import annotations

import pytest
from kvgpu.runtime import pod_holds

SPEC = {"podUID": "u1", "node": "n0"}


def _pod(uid: str = "u1", node: str | None = "n0", phase: str = "Running", deleting: bool = False) -> dict:
    meta: dict = {"uid": uid, **({"deletionTimestamp": "2026-12-01T00:00:00Z"} if deleting else {})}
    return {"metadata": meta, "spec": {"nodeName": node}, "status": {"phase": phase}}


@pytest.mark.parametrize("pod,holds", [
    (_pod(), True),
    (_pod(phase="Pending"), True),           # bound, containers not started yet
    (_pod(phase="Succeeded"), False),
    (_pod(phase="Failed"), False),
    (_pod(deleting=True), False),
    (_pod(uid="u2"), False),                 # another pod under the same name
    (_pod(node="n1"), False),                # bound elsewhere (a bind retried towards another node)
    (_pod(node=None), False),                # not bound (a bind in progress)
])
def test_pod_holds(pod, holds):
    assert pod_holds(pod, SPEC) is holds
