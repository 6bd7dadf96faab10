"""The real node's teardown ends the MPS control daemons its agent started (detached, in their
own session: they outlive the agent by design) before it removes their root; otherwise a daemon
left running loses its pipe and nothing can reach it again. Against the unit tests' fake
``nvidia-cuda-mps-control``, started as the agent starts it."""

from __future__ import annotations

import os
import signal
from pathlib import Path

from kvgpu.agent.mps import MpsDaemons
from kvgpu.devcluster.realhost import mps_daemons, stop_mps_daemons
from unit.test_agent_mps import A, B, fake, pid_of  # noqa: F401 (fake: the fixture)


def test_the_daemons_under_the_root_are_ended_and_no_other(fake: Path) -> None:  # noqa: F811
    other = fake.parent / "elsewhere"  # the fixture ends only the daemons under its root
    assert MpsDaemons(str(fake)).start(A) and MpsDaemons(str(other)).start(B)
    ours, theirs = pid_of(fake, A), pid_of(other, B)
    try:
        assert mps_daemons([fake]) == [ours]
        stop_mps_daemons([fake])
        assert mps_daemons([fake]) == []
        assert mps_daemons([other]) == [theirs]
    finally:
        os.kill(theirs, signal.SIGKILL)
