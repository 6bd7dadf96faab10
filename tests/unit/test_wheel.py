"""The wheel built from a clean checkout carries everything the product imports.

A temporary copy of the git-tracked files (no generated stubs, no shim build) is built with
``pip wheel`` (an isolated build: hatchling and grpcio-tools from PyPI, hatch_build.py generating
the gRPC stubs), then installed with its dependencies (pinned to this environment's versions)
into a fresh virtual environment, which imports the stubs and reads a region that the shim's C
code wrote, with no compiled shim module anywhere on its path.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest
from kvgpu import shimcore
from kvgpu.devcluster.productimages import runtime_pins

network = pytest.mark.network

ROOT = Path(__file__).resolve().parents[2]
STUBS = [f"kvgpu/agent/proto/{n}_pb2{g}.py" for n in ("deviceplugin", "podresources") for g in ("", "_grpc")]
MIB = 1 << 20
UUID = "GPU-5a110000-0000-0000-0000-000000000000"
PIP = ["-m", "pip", "--disable-pip-version-check", "--no-input", "-q"]


def _tracked_copy(dst: Path) -> None:
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout: the test builds from the git-tracked files")
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout.split(b"\0")
    for name in filter(None, files):
        src = ROOT / name.decode()
        if src.is_file():  # deleted-but-uncommitted files are listed too
            (dst / name.decode()).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst / name.decode())


@pytest.mark.parametrize("name", ["Dockerfile.operator", "Dockerfile.agent"])
def test_dockerfiles_copy_what_the_wheel_build_needs(name: str) -> None:
    """``pip install .`` in the Dockerfiles runs the build hook: it and gen_proto.py are copied."""
    hook = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["hatch"]["build"]["targets"]["wheel"][
        "hooks"]["custom"]["path"]
    copied = " ".join(line for line in (ROOT / name).read_text().splitlines()
                      if line.startswith("COPY ") and "--from=" not in line).split()
    assert hook in copied and "hack/gen_proto.py" in copied and "pyproject.toml" in copied, copied


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    _tracked_copy(src)
    assert not list(src.rglob("*_pb2*.py")), "generated stubs are not tracked"
    subprocess.run([sys.executable, *PIP, "wheel", "--no-deps", "-w", str(tmp / "dist"), f"{src}/"], check=True)
    (whl,) = (tmp / "dist").glob("kvgpu-*.whl")
    return whl


@network
@pytest.mark.timeout(300)
def test_wheel_carries_the_stubs_and_the_region_reader(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    missing = [n for n in [*STUBS, "kvgpu/shimregion.py", "kvgpu/agent/usage.py"] if n not in names]
    assert not missing, missing
    assert not [n for n in names if n.endswith(".so")], "a pure wheel: no compiled module"
    meta = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("METADATA"))).decode()
    # the generated code's own runtime checks, as dependencies
    assert "Requires-Dist: grpcio>=1." in meta and "Requires-Dist: protobuf>=" in meta, meta


def _region(path: Path) -> None:
    """A region written by the shim's C code: one process, 700 MiB of a 3000 MiB limit."""
    m = shimcore.core()
    cfg = m.ffi.new("struct vgpu_config *")
    assert m.lib.vgpu_claim_parse(f"v1;claim=team-a/job;priority=1;dev={UUID},3000,30".encode(), cfg) == 0
    h = m.ffi.new("struct vgpu_region_handle *")
    assert m.lib.vgpu_region_open(h, str(path).encode(), cfg) == 0
    assert m.lib.vgpu_region_join(h, 1, m.lib.vgpu_proc_start_time(1)) >= 0  # PID 1 outlives the test
    assert m.lib.vgpu_region_reserve(h, 0, 700 * MIB) == 0
    m.lib.vgpu_region_close(h)  # the slot stays: PID 1 lives


@network
@pytest.mark.timeout(300)
def test_fresh_venv_with_only_the_wheel(wheel: Path, tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    py = venv / "bin" / "python"
    pins = tmp_path / "pins.txt"
    pins.write_text("\n".join(runtime_pins()) + "\n")
    subprocess.run([str(py), *PIP, "install", "-c", str(pins), str(wheel)], check=True)
    region = tmp_path / "vgpu.region"
    _region(region)
    script = (
        "import importlib.util, kvgpu\n"
        "from kvgpu.agent.proto import deviceplugin_pb2_grpc, podresources_pb2_grpc, pb2\n"
        "from kvgpu.agent.usage import default_reader\n"
        "import kvgpu.agent.main, kvgpu.cli.main\n"
        "assert importlib.util.find_spec('_vgpucore') is None\n"
        f"rows = default_reader()(__import__('pathlib').Path({str(tmp_path)!r}))\n"
        "print(kvgpu.__file__, pb2.Mount.__name__, [(r.uuid, r.limit_mib, r.used_mib) for r in rows])\n"
    )
    out = subprocess.run([str(py), "-c", script], cwd=tmp_path, capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr
    where, mount, rows = out.stdout.split(" ", 2)
    assert where.startswith(str(venv)), where
    assert mount == "Mount"
    assert rows.strip() == f"[({UUID!r}, 3000, 700.0)]"
