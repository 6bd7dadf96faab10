"""`make demo` end to end (its own control plane and real node, in a temporary directory): the
seed pods start as containers on the real kubelet (Running because the kubelet said so), their
claims hold their cards, and inside the seed pod NVML shows 3000 MiB and a CUDA program hits the out-of-memory
error; nothing the demo started keeps running, nothing is left on the host.

It needs the machine's real-node lock, so it runs before tests/realnode's session node starts
(pytest's collection order: tests/cluster before tests/realnode)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from kvgpu.devcluster.realnode import leftovers


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


@pytest.mark.realnode
@pytest.mark.timeout(400)
def test_demo_runs_the_seed_walkthrough_and_leaves_nothing(tmp_path: Path) -> None:
    run_dir = tmp_path / "demo"
    p = subprocess.run([sys.executable, "-m", "kvgpu.demo"], capture_output=True, text=True, timeout=380,
                       env=dict(os.environ, KVGPU_DEMO_DIR=str(run_dir)))
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-4000:]
    assert "NO REAL NODE" not in out, out[-4000:]
    assert "kvgpu-real-0" in out and "containerd://2." in out  # kubectl get nodes -o wide
    assert "3000Mi" in out and "Running" in out  # the claims (kubectl get vgpuclaims), the pods
    assert "0MiB / 3000MiB" in out  # NVML inside the seed pod
    assert "CUDA_ERROR_OUT_OF_MEMORY" in out and "inside the pod" in out
    assert _running_in(run_dir) == []
    assert leftovers() == []
