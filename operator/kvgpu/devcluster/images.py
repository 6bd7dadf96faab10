"""Container images for the dev cluster's real node, built from local files (no registry).

A tiny docker-archive writer (:func:`write_docker_archive`: one layer from a directory,
deterministic — sorted entries, mtime 0, uid/gid 0 unless an owner is given) and the recipes:

- ``kvgpu.local/pause:1`` — the sandbox image: hack/realnode/pause.c, ``gcc -static``.
- ``kvgpu.local/tenant:1`` — a "CUDA tenant": busybox-static applets, the host's glibc (the
  ``ldd`` closure of everything below, with an ``ld.so.cache``), python3.11 with a trimmed
  standard library and ``pynvml.py``, the test CUDA client ``cuprog`` (tests/shim/prog/cuprog.c,
  linked against the stub ``libcuda.so.1`` but with no rpath) and a dynamic ``gcat`` (the
  host's ``cat``, for ld.so.preload checks). ``libcuda.so.1`` is *not* in the image: the
  device plugin mounts the node's driver directory at ``/usr/local/nvidia``, and the image's
  ``LD_LIBRARY_PATH`` / ``PATH`` name ``/usr/local/nvidia/lib64`` / ``/usr/local/nvidia/bin``.
- ``kvgpu.local/tenant-nonroot:1`` — the same layer, ``User: "1000:1000"`` (user ``tenant``).

:func:`build_driver_root` builds the simulated node's driver directory (``lib64/libcuda.so.1``
and ``lib64/libnvidia-ml.so.1`` from tests/shim/stub), what the device plugin hands to
containers.

Every build lands in ``${KVGPU_CACHE:-~/.cache/kvgpu}/images/<recipe>-<key>/`` where the key
hashes the recipe's inputs, so a rebuild happens only when an input changed. Images are
imported with ``ctr -n k8s.io images import`` (:func:`import_image`).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import stat
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[3]
PAUSE_C = REPO_ROOT / "hack" / "realnode" / "pause.c"
STUB_DIR = REPO_ROOT / "tests" / "shim" / "stub"
CUPROG_C = REPO_ROOT / "tests" / "shim" / "prog" / "cuprog.c"
RECIPE_VERSION = "2"  # bump when a recipe changes in a way its inputs do not show

PAUSE = "kvgpu.local/pause:1"
TENANT = "kvgpu.local/tenant:1"
TENANT_NONROOT = "kvgpu.local/tenant-nonroot:1"
HOSTROOT = "kvgpu.local/hostroot:1"
# What every glibc distribution's libc package ships besides libc.so.6 (since 2.34 libdl and
# libpthread are empty compatibility stubs, still there): the shim needs libdl.so.2 and
# libpthread.so.0 to load in an image of glibc < 2.34 too, so a "real" tenant image has them.
GLIBC_PACKAGE = tuple(f"/lib/x86_64-linux-gnu/{n}" for n in ("libc.so.6", "libdl.so.2", "libpthread.so.0",
                                                               "librt.so.1", "libm.so.6"))
TENANT_UID = 1000
DRIVER_MOUNT = "/usr/local/nvidia"  # where the node's driver directory appears in a container
TENANT_ENV = (
    f"PATH={DRIVER_MOUNT}/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    f"LD_LIBRARY_PATH={DRIVER_MOUNT}/lib64",
    "STUB_MEM_MIB=143771",  # the stub driver's card size: an H200, as in the simulated inventory
    "STUB_STATE=/tmp/stub.state",  # the stub's shared state, per container (/tmp is the container's)
    "PYTHONDONTWRITEBYTECODE=1",
)
PY_SKIP = {"test", "idlelib", "tkinter", "ensurepip", "__pycache__", "lib2to3", "turtledemo", "pydoc_data",
           "unittest/test", "distutils/tests", "ctypes/test", "sqlite3/test", "config-3.11-x86_64-linux-gnu"}


class ImageError(RuntimeError):
    """An image could not be built (missing host tool or file) or imported."""


def cache_root() -> Path:
    return Path(os.environ.get("KVGPU_CACHE") or Path.home() / ".cache" / "kvgpu")


# ----- the archive writer ---------------------------------------------------------------------
@dataclass(frozen=True)
class ImageConfig:
    """The parts of an OCI/docker image config that the recipes use."""

    ref: str  # e.g. kvgpu.local/pause:1 (a dotted host, so containerd does not prefix docker.io)
    entrypoint: Sequence[str] | None = None
    cmd: Sequence[str] | None = None
    env: Sequence[str] = ("PATH=/usr/sbin:/usr/bin:/sbin:/bin",)
    user: str = ""
    working_dir: str = "/"

    def to_json(self, diff_id: str) -> dict[str, Any]:
        cfg: dict[str, Any] = {"Env": list(self.env), "WorkingDir": self.working_dir}
        if self.entrypoint:
            cfg["Entrypoint"] = list(self.entrypoint)
        if self.cmd:
            cfg["Cmd"] = list(self.cmd)
        if self.user:
            cfg["User"] = self.user
        return {"architecture": "amd64", "os": "linux", "created": "1970-01-01T00:00:00Z", "config": cfg,
                "rootfs": {"type": "layers", "diff_ids": [diff_id]},
                "history": [{"created": "1970-01-01T00:00:00Z", "created_by": "kvgpu.devcluster.images"}]}


def layer_from_dir(root: Path, owners: Mapping[str, tuple[int, int]] | None = None) -> bytes:
    """A deterministic tar of ``root``'s contents: sorted, mtime 0, uid/gid 0 (``owners`` maps
    a relative path to (uid, gid) for exceptions), no user/group names. Hard links are stored
    as copies; symlinks, directories and modes are kept."""
    owners = owners or {}
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as t:
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames.sort()
            for name in sorted(dirnames + filenames):
                p = Path(dirpath) / name
                arc = p.relative_to(root).as_posix()
                st = p.lstat()
                ti = tarfile.TarInfo(arc)
                ti.mode = stat.S_IMODE(st.st_mode)
                ti.uid, ti.gid = owners.get(arc, (0, 0))
                ti.uname = ti.gname = ""
                ti.mtime = 0
                if stat.S_ISLNK(st.st_mode):
                    ti.type, ti.linkname = tarfile.SYMTYPE, os.readlink(p)
                    t.addfile(ti)
                elif stat.S_ISDIR(st.st_mode):
                    ti.type = tarfile.DIRTYPE
                    t.addfile(ti)
                elif stat.S_ISREG(st.st_mode):
                    ti.size = st.st_size
                    with p.open("rb") as f:
                        t.addfile(ti, f)
                else:
                    raise ImageError(f"{p}: only files, directories and symlinks go into an image")
    return buf.getvalue()


def write_docker_archive(out: Path, layer: bytes, configs: Iterable[ImageConfig]) -> None:
    """A ``docker save``-style tarball of one layer and one or more image configs (tags) that
    share it; ``ctr images import`` reads it."""
    lsha = hashlib.sha256(layer).hexdigest()
    members: list[tuple[str, bytes]] = [(f"{lsha}/layer.tar", layer)]
    manifest = []
    for c in configs:
        cb = json.dumps(c.to_json(f"sha256:{lsha}"), sort_keys=True).encode()
        csha = hashlib.sha256(cb).hexdigest()
        members.append((f"{csha}.json", cb))
        manifest.append({"Config": f"{csha}.json", "RepoTags": [c.ref], "Layers": [f"{lsha}/layer.tar"]})
    members.append(("manifest.json", json.dumps(manifest).encode()))
    tmp = out.with_suffix(".tmp")
    with tarfile.open(tmp, "w", format=tarfile.PAX_FORMAT) as t:
        for arc, data in members:
            ti = tarfile.TarInfo(arc)
            ti.size, ti.mtime, ti.mode = len(data), 0, 0o644
            t.addfile(ti, io.BytesIO(data))
    tmp.replace(out)


def import_image(ctr: Sequence[str], archive: Path) -> None:
    """``ctr ... -n k8s.io images import``; ``ctr`` is the command with ``--address=<abs socket>``."""
    p = subprocess.run([*ctr, "-n", "k8s.io", "images", "import", "--no-unpack=false", str(archive)],
                       capture_output=True, text=True, check=False)
    if p.returncode != 0:  # older ctr without --no-unpack
        p = subprocess.run([*ctr, "-n", "k8s.io", "images", "import", str(archive)],
                           capture_output=True, text=True, check=False)
    if p.returncode != 0:
        raise ImageError(f"ctr images import {archive} failed ({p.returncode}): {p.stderr.strip()}")


# ----- caching ------------------------------------------------------------------------------
def _hash_inputs(parts: Iterable[str | Path]) -> str:
    h = hashlib.sha256(RECIPE_VERSION.encode())
    for part in parts:
        if isinstance(part, Path):
            if part.is_dir():
                for f in sorted(part.rglob("*")):
                    if f.is_file():
                        st = f.stat()
                        h.update(f"{f}:{st.st_size}:{st.st_mtime_ns}".encode())
            else:
                h.update(str(part).encode())
                h.update(part.read_bytes())
        else:
            h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()[:12]


def _cc() -> str:
    cc = os.environ.get("CC", "gcc")
    if not shutil.which(cc):
        raise ImageError(f"no C compiler ({cc}) on PATH: the real node's images and stub driver need gcc")
    return cc


def _run(cmd: Sequence[str], what: str) -> None:
    p = subprocess.run(list(cmd), capture_output=True, text=True, check=False)
    if p.returncode != 0:
        raise ImageError(f"{what} failed ({p.returncode}): {' '.join(cmd)}\n{p.stderr.strip()}")


def _cc_version(cc: str) -> str:
    return subprocess.run([cc, "--version"], capture_output=True, text=True, check=False).stdout


@dataclass
class BuiltImage:
    refs: tuple[str, ...]
    archive: Path


def _cached(recipe: str, key: str, refs: tuple[str, ...], build: Any) -> BuiltImage:
    d = cache_root() / "images" / f"{recipe}-{key}"
    archive = d / "image.tar"
    if (d / ".complete").exists() and archive.exists():
        return BuiltImage(refs, archive)
    d.mkdir(parents=True, exist_ok=True)
    print(f"images: building {', '.join(refs)} into {d}", file=sys.stderr)
    with tempfile.TemporaryDirectory(dir=d) as tmp:
        build(Path(tmp), archive)
    (d / ".complete").touch()
    return BuiltImage(refs, archive)


# ----- recipes -------------------------------------------------------------------------------
def build_pause() -> BuiltImage:
    cc = _cc()
    key = _hash_inputs([PAUSE_C, _cc_version(cc)])

    def build(tmp: Path, archive: Path) -> None:
        root = tmp / "root"
        root.mkdir()
        _run([cc, "-static", "-Os", "-s", "-o", str(root / "pause"), str(PAUSE_C)], "gcc -static pause.c")
        write_docker_archive(archive, layer_from_dir(root), [ImageConfig(PAUSE, entrypoint=["/pause"])])

    return _cached("pause", key, (PAUSE,), build)


def _pynvml_source() -> Path:
    try:
        import pynvml  # the venv's nvidia-ml-py
    except ImportError as e:
        raise ImageError("pynvml (nvidia-ml-py) is not installed in this Python; run `make install`") from e
    return Path(pynvml.__file__)


def _is_static(p: Path) -> bool:
    out = subprocess.run(["ldd", str(p)], capture_output=True, text=True, check=False)
    return "not a dynamic executable" in out.stdout + out.stderr or "statically linked" in out.stdout


def _busybox() -> Path:
    for p in (Path("/bin/busybox"), Path("/usr/bin/busybox")):
        if p.exists() and _is_static(p):
            return p
    raise ImageError("no static busybox (/bin/busybox): apt-get install busybox-static (or `make realnode`)")


def _ldd(paths: Iterable[Path]) -> set[str]:
    libs: set[str] = set()
    for p in paths:
        out = subprocess.run(["ldd", str(p)], capture_output=True, text=True, check=False).stdout
        if "not found" in out:  # an optional extension module whose library the host lacks: skip it
            continue
        for line in out.splitlines():
            parts = line.split()
            if "=>" in parts:
                i = parts.index("=>")
                if i + 1 < len(parts) and parts[i + 1].startswith("/"):
                    libs.add(parts[i + 1])
            elif parts and parts[0].startswith("/"):
                libs.add(parts[0])  # the dynamic loader
    return libs


def _copy_host_path(src: str, root: Path) -> None:
    """Copy a host file into ``root`` at the same path, reproducing the symlinks of its last
    component (libfoo.so.1 -> libfoo.so.1.2.3); directory symlinks (merged /usr) are resolved
    and recreated by the caller."""
    seen = 0
    path = os.path.join(os.path.realpath(os.path.dirname(src)), os.path.basename(src))
    while True:
        dest = root / path.lstrip("/")
        dest.parent.mkdir(parents=True, exist_ok=True)
        if os.path.islink(path):
            link = os.readlink(path)
            if not dest.is_symlink():
                dest.symlink_to(link)
            path = os.path.normpath(os.path.join(os.path.dirname(path), link))
            path = os.path.join(os.path.realpath(os.path.dirname(path)), os.path.basename(path))
            seen += 1
            if seen > 20:
                raise ImageError(f"symlink loop at {src}")
            continue
        if not dest.exists():
            shutil.copy2(path, dest)
        return


def _copy_tree(src: Path, dest: Path, skip: set[str]) -> list[Path]:
    """Copy a directory tree without the relative paths in ``skip``; returns the ELF files."""
    elfs = []
    for dirpath, dirnames, filenames in os.walk(src):
        rel = Path(dirpath).relative_to(src)
        dirnames[:] = sorted(d for d in dirnames if d not in skip and (rel / d).as_posix() not in skip)
        (dest / rel).mkdir(parents=True, exist_ok=True)
        for f in filenames:
            s = Path(dirpath) / f
            if s.suffix in (".pyc", ".pyo"):
                continue
            d = dest / rel / f
            if s.is_symlink():
                d.symlink_to(os.readlink(s))
                continue
            shutil.copy2(s, d)
            if s.suffix == ".so":
                elfs.append(s)
    return elfs


def _tenant_inputs() -> tuple[Path, Path, Path]:
    py = Path("/usr/bin/python3.11")
    stdlib = Path("/usr/lib/python3.11")
    if not py.exists() or not stdlib.is_dir():
        raise ImageError("the tenant image takes the host's python3.11 (/usr/bin/python3.11, /usr/lib/python3.11)")
    return py, stdlib, _busybox()


def build_tenant() -> BuiltImage:
    """``kvgpu.local/tenant:1`` and ``kvgpu.local/tenant-nonroot:1`` (one archive, one layer)."""
    cc = _cc()
    py, stdlib, busybox = _tenant_inputs()
    pynvml = _pynvml_source()
    key = _hash_inputs([py, busybox, pynvml, CUPROG_C, STUB_DIR / "libcuda_stub.c", STUB_DIR / "stub_state.h",
                        Path("/usr/bin/cat"), _cc_version(cc), stdlib, "\n".join(TENANT_ENV),
                        Path("/lib/x86_64-linux-gnu/libc.so.6")])

    def build(tmp: Path, archive: Path) -> None:
        root = tmp / "root"
        for d in ("usr/bin", "usr/sbin", "usr/lib", "usr/lib64", "etc", "proc", "sys", "dev", "root",
                  "home/tenant", "usr/local/bin", "var/run", "run"):
            (root / d).mkdir(parents=True, exist_ok=True)
        for top in ("bin", "sbin", "lib", "lib64"):  # merged /usr, as on the host
            (root / top).symlink_to(f"usr/{top}")
        (root / "tmp").mkdir()
        (root / "tmp").chmod(0o1777)
        # busybox applets
        shutil.copy2(busybox, root / "usr/bin/busybox")
        applets = subprocess.run([str(busybox), "--list"], capture_output=True, text=True, check=True).stdout.split()
        for a in applets:
            if a != "busybox" and not (root / "usr/bin" / a).exists():
                (root / "usr/bin" / a).symlink_to("busybox")
        # python
        shutil.copy2(py, root / "usr/bin/python3.11")
        for name in ("python3", "python"):
            (root / "usr/bin" / name).unlink(missing_ok=True)
            (root / "usr/bin" / name).symlink_to("python3.11")
        ext = _copy_tree(stdlib, root / "usr/lib/python3.11", PY_SKIP)
        shutil.copy2(pynvml, root / "usr/lib/python3.11/pynvml.py")
        # cuprog: linked against the stub libcuda, no rpath (libcuda.so.1 comes from the node)
        stub = tmp / "stub"
        stub.mkdir()
        _run([cc, "-shared", "-fPIC", "-O2", "-o", str(stub / "libcuda.so.1"), str(STUB_DIR / "libcuda_stub.c"),
              "-lpthread"], "gcc libcuda_stub.c")
        _run([cc, "-O2", "-o", str(root / "usr/bin/cuprog"), str(CUPROG_C), f"-L{stub}", "-l:libcuda.so.1", "-ldl"],
             "gcc cuprog.c")
        shutil.copy2("/usr/bin/cat", root / "usr/bin/gcat")  # a dynamic program: ld.so.preload applies
        # glibc and friends: the ldd closure (the stub's deps stand in for the real driver's)
        closure = _ldd([py, root / "usr/bin/cuprog", root / "usr/bin/gcat", stub / "libcuda.so.1", *ext])
        for lib in sorted(closure | set(GLIBC_PACKAGE)):
            _copy_host_path(lib, root)
        (root / "etc/ld.so.conf").write_text("/usr/local/lib\n/usr/lib/x86_64-linux-gnu\n/usr/lib64\n")
        ld = subprocess.run(["ldconfig", "-r", str(root)], capture_output=True, text=True, check=False)
        if ld.returncode != 0:
            raise ImageError(f"ldconfig -r {root} failed (needs root for chroot): {ld.stderr.strip()}")
        (root / "var/cache/ldconfig").mkdir(parents=True, exist_ok=True)
        (root / "etc/passwd").write_text("root:x:0:0:root:/root:/bin/sh\n"
                                         f"tenant:x:{TENANT_UID}:{TENANT_UID}:tenant:/home/tenant:/bin/sh\n"
                                         "nobody:x:65534:65534:nobody:/nonexistent:/bin/false\n")
        (root / "etc/group").write_text(f"root:x:0:\ntenant:x:{TENANT_UID}:\nnogroup:x:65534:\n")
        (root / "etc/hostname").write_text("tenant\n")
        owners = {"home/tenant": (TENANT_UID, TENANT_UID)}
        layer = layer_from_dir(root, owners)
        base = ImageConfig(TENANT, cmd=["/bin/sh"], env=(*TENANT_ENV, "HOME=/root"))
        nonroot = ImageConfig(TENANT_NONROOT, cmd=["/bin/sh"], env=(*TENANT_ENV, "HOME=/home/tenant"),
                              user=f"{TENANT_UID}:{TENANT_UID}")
        write_docker_archive(archive, layer, [base, nonroot])

    return _cached("tenant", key, (TENANT, TENANT_NONROOT), build)


def build_all() -> list[BuiltImage]:
    return [build_pause(), build_tenant()]


def build_hostroot() -> BuiltImage:
    """``kvgpu.local/hostroot:1``: an empty merged-/usr root (``bin``, ``lib``… link into ``usr``)
    with the host's loader cache, for a pod that mounts the host's ``/usr`` read-only on its
    ``/usr`` — the GPU machine's run, where torch and its CUDA libraries (several GB) are on the
    host and no registry can be reached. Nothing else of the host is in it."""
    etc = [Path("/etc/ld.so.cache"), Path("/etc/ld.so.conf")]
    key = _hash_inputs([*(p for p in etc if p.exists()), "hostroot-2"])

    def build(tmp: Path, archive: Path) -> None:
        root = tmp / "root"
        for d in ("usr", "etc", "proc", "sys", "dev", "root", "opt", "repo", "var/run", "run"):
            (root / d).mkdir(parents=True, exist_ok=True)
        for top in ("bin", "sbin", "lib", "lib64"):
            (root / top).symlink_to(f"usr/{top}")
        (root / "tmp").mkdir()
        (root / "tmp").chmod(0o1777)
        for p in etc:
            if p.exists():
                shutil.copy2(p, root / "etc" / p.name)
        (root / "etc/passwd").write_text("root:x:0:0:root:/root:/bin/sh\n"
                                         f"tenant:x:{TENANT_UID}:{TENANT_UID}:tenant:/tmp:/bin/sh\n")
        (root / "etc/group").write_text(f"root:x:0:\ntenant:x:{TENANT_UID}:\n")
        env = (f"PATH={DRIVER_MOUNT}/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
               f"LD_LIBRARY_PATH={DRIVER_MOUNT}/lib64", "HOME=/root")
        write_docker_archive(archive, layer_from_dir(root), [ImageConfig(HOSTROOT, cmd=["/bin/sh"], env=env)])

    return _cached("hostroot", key, (HOSTROOT,), build)


# ----- the simulated node's driver -----------------------------------------------------------
@dataclass
class DriverRoot:
    path: Path
    libs: list[str] = field(default_factory=list)

    @property
    def lib64(self) -> Path:
        return self.path / "lib64"


def build_driver_root(dest: Path) -> DriverRoot:
    """The simulated node's driver directory at ``dest``: ``lib64/libcuda.so.1`` and
    ``lib64/libnvidia-ml.so.1`` (the stub driver of tests/shim/stub), an empty ``bin/``.
    Built once into the cache, copied to ``dest``."""
    cc = _cc()
    key = _hash_inputs([*sorted(STUB_DIR.glob("*.[ch]")), _cc_version(cc)])
    cache = cache_root() / "images" / f"driver-{key}"
    libs = ["libcuda.so.1", "libnvidia-ml.so.1"]
    if not (cache / ".complete").exists():
        (cache / "lib64").mkdir(parents=True, exist_ok=True)
        for lib, src in zip(libs, ("libcuda_stub.c", "libnvml_stub.c"), strict=True):
            _run([cc, "-shared", "-fPIC", "-O2", "-o", str(cache / "lib64" / lib), str(STUB_DIR / src),
                  "-lpthread"], f"gcc {src}")
        (cache / ".complete").touch()
    (dest / "lib64").mkdir(parents=True, exist_ok=True)
    (dest / "bin").mkdir(exist_ok=True)
    for lib in libs:
        shutil.copy2(cache / "lib64" / lib, dest / "lib64" / lib)
    return DriverRoot(dest, libs)


if __name__ == "__main__":  # python -m kvgpu.devcluster.images: build (or find) them all
    for img in build_all():
        print(img.archive, *img.refs)
