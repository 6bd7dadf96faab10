"""``mode=mps`` claims on the stub driver: the shim makes the process the MPS client its claim
says, whatever the process's own env says, and refuses CUDA when no control daemon listens
(CUDA would otherwise run outside MPS, without an SM limit, and the shim's gate is off for MPS).
"""

from __future__ import annotations

import sys

from kvgpu.shimcore import read_region

from .conftest import claim

PROBE = r"""
import ctypes, json
cuda = ctypes.CDLL("libcuda.so.1")
libc = ctypes.CDLL(None)
libc.getenv.restype = ctypes.c_char_p
rc = cuda.cuInit(0)
get = lambda k: (libc.getenv(k.encode()) or b"").decode()
print(json.dumps({"rc": rc, **{k: get(k) for k in ("CUDA_MPS_PIPE_DIRECTORY",
      "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT")}}))
"""

MPS_CLAIM = claim((0, 1000, 30)) + ";mode=mps"


def test_no_control_daemon_fails_closed(box):
    pipe = box.dir / "pipe"
    pipe.mkdir()
    p = box.run(sys.executable, "-c", PROBE, env=box.env(MPS_CLAIM, CUDA_MPS_PIPE_DIRECTORY=pipe))
    assert '"rc": 3' in p.stdout  # CUDA_ERROR_NOT_INITIALIZED
    assert "no MPS control daemon listens" in p.stderr


def test_the_claim_sets_the_client_env_over_the_process_env(box):
    pipe = box.dir / "pipe"
    pipe.mkdir()
    (pipe / "control").write_text("")  # stands for the daemon's socket
    env = box.env(MPS_CLAIM, CUDA_MPS_PIPE_DIRECTORY=pipe, CUDA_MPS_ACTIVE_THREAD_PERCENTAGE="100",
                  CUDA_MPS_PINNED_DEVICE_MEM_LIMIT="0=100G")
    out = box.json(sys.executable, "-c", PROBE, env=env)[0]
    assert out == {"rc": 0, "CUDA_MPS_PIPE_DIRECTORY": str(pipe),
                   "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "30", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=1000M"}
    # the shim's compute gate is off: the region records no cores (the driver partitions SMs)
    box.run("info", env=env)
    assert [d.cores for d in read_region(box.region).devices] == [0]


def test_hami_core_claims_get_no_mps_env(box):
    out = box.json(sys.executable, "-c", PROBE, env=box.env(claim((0, 1000, 30))))[0]
    assert out["rc"] == 0 and out["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == ""
