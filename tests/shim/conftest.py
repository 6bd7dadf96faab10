"""Fixtures for the shim's CPU tests.

``shimkit`` (session): makes sure ``shim/_build/libvgpu.so`` and the cffi module exist (runs
``shim/build.py`` when they are missing or older than the sources), and compiles the stub
driver (``tests/shim/stub``: libcuda.so.1, libnvidia-ml.so.1) and the ``cuprog`` client into a
temporary directory with gcc.

``box`` (per test): a fresh region directory and stub state file, and helpers to run
``cuprog`` (or any command) with or without the shim under a given claim.

Sanitizer runs (``make check-sanitize``): ``KVGPU_TEST_SHIM`` names another build of the
library (``shim/_build/asan/libvgpu.so``) and ``KVGPU_TEST_PRELOAD`` what must be preloaded
before it (the sanitizer runtime, which has to come first); the sanitizer's options
(``ASAN_OPTIONS``/``TSAN_OPTIONS``, with a ``log_path``) pass through to every program.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
SHIM = ROOT / "shim"
BUILD = SHIM / "_build"
LIB = BUILD / "libvgpu.so"
STUB = Path(__file__).resolve().parent / "stub"
PROG = Path(__file__).resolve().parent / "prog"
MIB = 1024 * 1024


def uuid(i: int) -> str:
    """UUID of the stub's physical card i (see stub_state.h)."""
    return f"GPU-5a110000-0000-0000-0000-0000000000{i:02x}"


def claim(*devs: tuple[int, int, int], name: str = "team-a/job", priority: int = 1) -> str:
    """KVGPU_CLAIM for (card, memory MiB, cores %) triples."""
    parts = ["v1", f"claim={name}", f"priority={priority}"]
    parts += [f"dev={uuid(i)},{mem},{cores}" for i, mem, cores in devs]
    return ";".join(parts)


def _stale() -> bool:
    mods = list(BUILD.glob("_vgpucore*.so"))
    if not LIB.exists() or not mods:
        return True
    sources = list(SHIM.glob("*.c")) + list(SHIM.glob("*.h")) + [SHIM / "build.py"]
    newest = max(p.stat().st_mtime for p in sources)
    return min(p.stat().st_mtime for p in [LIB, *mods]) < newest


@dataclass
class ShimKit:
    lib: Path
    stubdir: Path
    cuprog: Path


@pytest.fixture(scope="session")
def shimkit(tmp_path_factory: pytest.TempPathFactory) -> ShimKit:
    if _stale():
        subprocess.run([sys.executable, str(SHIM / "build.py")], check=True, capture_output=True)
    lib = Path(os.environ.get("KVGPU_TEST_SHIM") or LIB)
    d = tmp_path_factory.mktemp("stubdrv")
    cc = os.environ.get("CC", "gcc")
    common = [cc, "-O2", "-fPIC", "-shared", "-Wl,-Bsymbolic", "-pthread", f"-I{STUB}"]
    subprocess.run([*common, "-Wl,-soname,libcuda.so.1", "-o", str(d / "libcuda.so.1"),
                    str(STUB / "libcuda_stub.c")], check=True)
    subprocess.run([*common, "-Wl,-soname,libnvidia-ml.so.1", "-o", str(d / "libnvidia-ml.so.1"),
                    str(STUB / "libnvml_stub.c")], check=True)
    subprocess.run([cc, "-O2", "-pthread", "-o", str(d / "cuprog"), str(PROG / "cuprog.c"), "-ldl",
                    str(d / "libcuda.so.1")], check=True)
    subprocess.run([cc, "-O2", "-o", str(d / "memprog"), str(PROG / "memprog.c"), "-ldl",
                    str(d / "libcuda.so.1")], check=True)
    return ShimKit(lib=lib, stubdir=d, cuprog=d / "cuprog")


@dataclass
class Box:
    kit: ShimKit
    dir: Path
    base_env: dict[str, str] = field(default_factory=dict)

    @property
    def region(self) -> Path:
        return self.dir / "region" / "vgpu.region"

    def env(self, claim_str: str | None = None, shim: bool = True, **extra: Any) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("KVGPU_", "CUDA_", "STUB_"))}
        env.pop("LD_PRELOAD", None)
        env.update(self.base_env)
        if shim:
            first = os.environ.get("KVGPU_TEST_PRELOAD")
            env["LD_PRELOAD"] = f"{first}:{self.kit.lib}" if first else str(self.kit.lib)
        if claim_str is not None:
            env["KVGPU_CLAIM"] = claim_str
        env.update({k: str(v) for k, v in extra.items()})
        return env

    def run(self, *args: str, env: dict[str, str], timeout: float = 60, check: bool = True
            ) -> subprocess.CompletedProcess[str]:
        cmd = [str(self.kit.cuprog), *args] if args and not args[0].startswith("/") else list(args)
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        if check and p.returncode != 0:
            raise AssertionError(f"{cmd} rc={p.returncode}\nstdout={p.stdout}\nstderr={p.stderr}")
        return p

    def json(self, *args: str, env: dict[str, str], **kw: Any) -> list[dict[str, Any]]:
        out = self.run(*args, env=env, **kw).stdout
        return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


@pytest.fixture
def box(shimkit: ShimKit, tmp_path: Path) -> Box:
    (tmp_path / "region").mkdir()
    base = {
        "LD_LIBRARY_PATH": str(shimkit.stubdir),
        "STUB_STATE": str(tmp_path / "stub.state"),
        "STUB_MEM_MIB": "4096",
        "STUB_CTX_MIB": "64",
        "STUB_KERNEL_US": "1000",
        "KVGPU_REGION_DIR": str(tmp_path / "region"),
    }
    return Box(kit=shimkit, dir=tmp_path, base_env=base)


@pytest.fixture(scope="session")
def core(shimkit: ShimKit):
    sys.path.insert(0, str(ROOT / "operator"))
    from kvgpu.shimcore import core as load

    return load()
