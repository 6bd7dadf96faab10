"""`make demo` end to end (its own control plane, in a temporary directory): the seed pod gets a
claim, and a process under the shim sees 3000 MiB and hits CUDA's out-of-memory error; nothing
the demo started keeps running."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest


def _running_in(run_dir: Path) -> list[str]:
    out = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if str(run_dir) in cmd:
            out.append(f"{pid}: {cmd[:120]}")
    return out


@pytest.mark.timeout(300)
def test_demo_runs_the_seed_walkthrough_and_leaves_nothing(tmp_path: Path) -> None:
    run_dir = tmp_path / "demo"
    p = subprocess.run([sys.executable, "-m", "kvgpu.demo"], capture_output=True, text=True, timeout=280,
                       env=dict(os.environ, KVGPU_DEMO_DIR=str(run_dir)))
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-4000:]
    assert "gpu-node-0" in out and "gpu-node-1" in out
    assert "3000Mi" in out and "Running" in out  # the claims, shown by kubectl get vgpuclaims
    assert "0MiB / 3000MiB" in out
    assert "CUDA_ERROR_OUT_OF_MEMORY" in out
    assert _running_in(run_dir) == []
