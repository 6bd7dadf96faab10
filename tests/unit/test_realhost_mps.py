"""The real node's teardown ends the MPS control daemons its agent started (detached, in their
own session: they outlive the agent by design) before it removes their root; otherwise a daemon
left running loses its pipe and nothing can reach it again. Against the unit tests' fake
``nvidia-cuda-mps-control``."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kvgpu.devcluster.realhost import mps_daemons, stop_mps_daemons
from unit.test_agent_mps import FAKE


def _start(root: Path, prog: Path, uuid: str) -> int:
    pipe, logs = root / uuid / "pipe", root / uuid / "log"
    pipe.mkdir(parents=True)
    logs.mkdir()
    env = {**os.environ, "CUDA_MPS_PIPE_DIRECTORY": str(pipe), "CUDA_MPS_LOG_DIRECTORY": str(logs),
           "CUDA_VISIBLE_DEVICES": uuid}
    subprocess.run([str(prog), "-d"], env=env, check=True, start_new_session=True)
    for _ in range(100):
        if (logs / "control.log").exists() and (logs / "control.log").read_text().strip():
            return int((logs / "control.log").read_text().split()[0])
        time.sleep(0.05)
    raise AssertionError("the fake daemon did not start")


def test_the_daemons_under_the_root_are_ended_and_no_other() -> None:
    d = Path(tempfile.mkdtemp(prefix="kmpsh", dir="/tmp"))  # unix socket paths must stay short
    prog = d / "bin" / "nvidia-cuda-mps-control"
    prog.parent.mkdir()
    prog.write_text(FAKE.replace("PYTHON", sys.executable))
    prog.chmod(prog.stat().st_mode | stat.S_IXUSR)
    pids = []
    try:
        ours = _start(d / "mps", prog, "GPU-aaaaaaaa")
        other = _start(d / "elsewhere", prog, "GPU-bbbbbbbb")
        pids = [ours, other]
        assert mps_daemons([d / "mps"]) == [ours]
        stop_mps_daemons([d / "mps"])
        assert not Path(f"/proc/{ours}").exists() or b"Z" in Path(f"/proc/{ours}/stat").read_bytes().split()[2]
        assert Path(f"/proc/{other}").exists() and mps_daemons([d / "elsewhere"]) == [other]
    finally:
        for pid in pids:
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass
        shutil.rmtree(d, ignore_errors=True)
