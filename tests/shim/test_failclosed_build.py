"""Fail closed on a broken claim; what the built library exports and links."""

from __future__ import annotations

import subprocess
import sys

import pytest

from .conftest import LIB, claim

NVML_INIT = "import ctypes; print(ctypes.CDLL('libnvidia-ml.so.1').nvmlInit_v2())"


@pytest.mark.parametrize(
    "env, needle",
    [
        ({"KVGPU_CLAIM": "v1;claim=ns/x;dev=GPU-1,0,10"}, "memory 1..2^30"),
        ({"KVGPU_CLAIM": ""}, "must start with 'v1;'"),
        ({"KVGPU_CLAIM": "v1;claim=Bad_Name/x;dev=GPU-1,10,10"}, "claim=Bad_Name/x"),
        ({"CUDA_DEVICE_MEMORY_LIMIT": "3Gi"}, "CUDA_DEVICE_MEMORY_LIMIT=3Gi"),
    ],
)
def test_broken_claim_stops_cuda_init(box, env, needle) -> None:
    e = box.env(**env)
    p = box.run("info", env=e, check=False)
    assert p.returncode == 3 and '"init_rc": 3' in p.stdout  # CUDA_ERROR_NOT_INITIALIZED
    assert "refusing to initialise CUDA: invalid GPU claim" in p.stderr and needle in p.stderr
    # every door is closed: cuGetProcAddress/dlsym users and NVML too
    assert box.run("fill", "gpa", "1048576", env=e, check=False).returncode == 3
    nv = box.run(sys.executable, "-c", NVML_INIT, env=e, check=False)
    assert nv.stdout.strip() == "1"  # NVML_ERROR_UNINITIALIZED


def test_broken_claim_file_fails_closed_even_with_good_env(box) -> None:
    f = box.dir / "claim"
    f.write_text("v1;claim=ns/x;dev=GPU-1,10,999")
    e = box.env(claim((0, 1000, 0)), KVGPU_CLAIM_FILE=f)
    p = box.run("info", env=e, check=False)
    assert p.returncode == 3 and "cores 0..100" in p.stderr


def test_disable_control_cannot_lift_a_claim(box) -> None:
    e = box.env(claim((0, 100, 0)), CUDA_DISABLE_CONTROL="true")
    assert box.json("info", env=e)[0]["total"] == 100 * 1024 * 1024


def test_processes_without_cuda_pay_nothing(box) -> None:
    p = box.run("/bin/sh", "-c", "echo hi", env=box.env(claim((0, 100, 0))))
    assert p.stdout == "hi\n" and p.stderr == ""
    assert not box.region.exists()


def test_exports_and_links() -> None:
    syms = subprocess.run(["nm", "-D", "--defined-only", str(LIB)], capture_output=True, text=True,
                          check=True).stdout.split()
    names = {s for s in syms if s[:2] in ("cu", "nv", "dl", "kv")}
    expected = {"dlsym", "kvgpu_shim_version", "cuInit", "cuGetProcAddress", "cuGetProcAddress_v2",
                "cuMemAlloc_v2", "cuMemGetInfo_v2", "cuLaunchKernel", "cuGraphLaunch",
                "nvmlDeviceGetMemoryInfo", "nvmlDeviceGetMemoryInfo_v2"}
    assert expected <= names
    assert not [s for s in names if s.startswith("vgpu_")]  # internals stay hidden
    deps = subprocess.run(["readelf", "-d", str(LIB)], capture_output=True, text=True, check=True).stdout
    needed = [ln for ln in deps.splitlines() if "NEEDED" in ln]
    assert not [ln for ln in needed if "python" in ln or "cuda" in ln or "nvidia" in ln], needed
    assert b"kvgpu-shim 0.1.0" in LIB.read_bytes()


def test_unusable_region_fails_closed(box) -> None:
    e = box.env(claim((0, 1000, 0)), KVGPU_REGION_DIR=box.dir / "no" / "such" / "dir")
    p = box.run("info", env=e, check=False)
    assert p.returncode == 3 and "cannot open the shared region" in p.stderr
