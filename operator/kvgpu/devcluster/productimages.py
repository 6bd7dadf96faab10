"""The product images, kvgpu-operator and kvgpu-agent, built without Docker for the real node.

An equivalent of Dockerfile.operator / Dockerfile.agent from local files (the archive writer and
host-copy helpers of :mod:`kvgpu.devcluster.images`), one docker-archive with both tags:

- ``kvgpu.local/kvgpu-operator:<version>`` and ``kvgpu.local/kvgpu-agent:<version>`` (the
  version of pyproject.toml), layers:

  1. *runtime*: the Python that runs this venv (``sys.base_prefix``: the interpreter,
     ``libpython`` if shared, the standard library trimmed like the tenant image's) laid out at
     ``/usr/local`` as in ``python:*-slim``; busybox applets for ``/bin/sh``; the ``ldd``
     closure of everything in the image (glibc, libssl, libffi, ...) with an ``ld.so.cache``.
  2. *deps*: the virtual environment ``/opt/kvgpu/venv`` (``pyvenv.cfg``, ``bin/python``) and
     kvgpu's runtime dependencies, pinned to the versions installed here (``[project]
     dependencies`` followed through the installed metadata; no ``dev`` extra), ``pip install
     --target ... --no-deps`` from PyPI.
  3. *kvgpu*: a wheel built from a copy of the Dockerfiles' build context (pyproject.toml,
     README.md, hatch_build.py, hack/gen_proto.py, operator/), its build hook generating the
     gRPC stubs into it as in the Dockerfiles' ``pip install .``, installed the same way;
     ``bin/kvgpu`` and ``bin/kubectl-vgpu``.
  4. *shim* (agent only): ``/opt/kvgpu/lib/libvgpu.so`` (shim/_build, the path the agent's
     DaemonSet passes as ``--shim-source``). Nothing else: the agent reads the shim's regions
     in plain Python (:mod:`kvgpu.shimregion`), no compiled module.

  Config as in the Dockerfiles: ``Entrypoint ["kvgpu"]``, ``Cmd ["operator"]`` / ``["agent"]``,
  ``User 65532:65532`` / ``0:0``, ``PATH=/opt/kvgpu/venv/bin:...``, ``PYTHONUNBUFFERED=1``,
  ``PYTHONDONTWRITEBYTECODE=1``. Byte code is compiled at build time with
  ``--invalidation-mode unchecked-hash`` (layers have mtime 0, so timestamp-checked ``.pyc``
  would be stale, and the manifests mount the root file system read-only).

The one difference from the Dockerfiles, on purpose: the Python is the host's (3.11, the one the
venv and its pins were tested with) rather than ``python:3.12-slim-bookworm``.

Built lazily (:meth:`kvgpu.devcluster.realnode.RealNode.import_product_images`, or ``python -m
kvgpu.devcluster.productimages``), cached in ``${KVGPU_CACHE:-~/.cache/kvgpu}/images/
product-<key>/`` where the key hashes pyproject.toml, README.md, the package sources, the
shim, the interpreter and the pins (earlier builds are removed). Progress goes to stderr.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import time
import tomllib
from collections.abc import Iterable, Sequence
from importlib import metadata
from pathlib import Path

from kvgpu.devcluster import images
from kvgpu.devcluster.images import REPO_ROOT, BuiltImage, ImageConfig, ImageError

RECIPE_VERSION = "3"  # bump when the recipe changes in a way its inputs do not show
PYPROJECT = REPO_ROOT / "pyproject.toml"
PACKAGE_DIR = REPO_ROOT / "operator" / "kvgpu"
GEN_PROTO = REPO_ROOT / "hack" / "gen_proto.py"
HATCH_BUILD = REPO_ROOT / "hatch_build.py"
SHIM_BUILD = REPO_ROOT / "shim" / "_build"
SHIM_SO = SHIM_BUILD / "libvgpu.so"
VENV = "/opt/kvgpu/venv"
SHIM_IN_IMAGE = "/opt/kvgpu/lib/libvgpu.so"  # Dockerfile.agent; the chart's agent --shim-source
OPERATOR_USER = "65532:65532"  # Dockerfile.operator
AGENT_USER = "0:0"  # Dockerfile.agent
NONROOT = "kvgpu"  # user and group 65532 (Dockerfile.operator's useradd)
PY = f"python{sys.version_info.major}.{sys.version_info.minor}"
SITE = f"{VENV}/lib/{PY}/site-packages"
PRODUCT_ENV = (
    f"PATH={VENV}/bin:/usr/local/bin:/usr/local/sbin:/usr/sbin:/usr/bin:/sbin:/bin",
    "PYTHONUNBUFFERED=1", "PYTHONDONTWRITEBYTECODE=1", "LANG=C.UTF-8",
)
STDLIB_SKIP = {*images.PY_SKIP, "site-packages", Path(sysconfig.get_config_var("LIBPL") or "config").name}


def version() -> str:
    return str(tomllib.loads(PYPROJECT.read_text())["project"]["version"])


def refs() -> tuple[str, str]:
    """(operator, agent) image references."""
    v = version()
    return f"kvgpu.local/kvgpu-operator:{v}", f"kvgpu.local/kvgpu-agent:{v}"


def _say(msg: str) -> None:
    print(f"images: {msg}", file=sys.stderr, flush=True)


# ----- inputs ---------------------------------------------------------------------------------
def runtime_pins() -> list[str]:
    """``name==version`` of every runtime dependency of kvgpu as installed in this environment
    (``[project] dependencies`` and theirs, markers evaluated here, no extras), sorted."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    pins: dict[str, str] = {}
    todo: list[tuple[str, set[str]]] = [("kvgpu", set())]
    while todo:
        name, extras = todo.pop()
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError as e:
            raise ImageError(f"{name} is not installed here: run `make install`") from e
        for line in dist.requires or []:
            req = Requirement(line)
            if req.marker and not any(req.marker.evaluate({"extra": x}) for x in (extras or {""})):
                continue
            key = canonicalize_name(req.name)
            if key == "kvgpu" or key in pins:
                continue
            try:
                pins[key] = metadata.version(req.name)
            except metadata.PackageNotFoundError as e:
                raise ImageError(f"{req.name} (a runtime dependency) is not installed here: make install") from e
            todo.append((req.name, set(req.extras)))
    return sorted(f"{k}=={v}" for k, v in pins.items())


def _interpreter() -> tuple[Path, Path | None, Path]:
    """(executable, shared libpython or None, stdlib) of the Python that runs this venv."""
    exe = Path(os.path.realpath(sys.executable))
    libpython = None
    if sysconfig.get_config_var("Py_ENABLE_SHARED"):
        so = sysconfig.get_config_var("INSTSONAME")
        libdir = sysconfig.get_config_var("LIBDIR")
        if so and libdir and (Path(libdir) / so).exists():
            libpython = Path(libdir) / so
        else:
            raise ImageError(f"{exe} is a shared-library build but its libpython ({libdir}/{so}) is missing")
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    if not (stdlib / "os.py").exists():
        raise ImageError(f"no standard library at {stdlib}")
    return exe, libpython, stdlib


def _source_digest(root: Path) -> str:
    """Content hash of a source tree without byte code and generated gRPC stubs."""
    h = hashlib.sha256()
    for f in sorted(root.rglob("*")):
        if f.is_file() and "__pycache__" not in f.parts and f.suffix not in (".pyc", ".so") \
                and not f.name.endswith(("_pb2.py", "_pb2_grpc.py")):
            h.update(f.relative_to(root).as_posix().encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()


# ----- steps ------------------------------------------------------------------------------------
def _run(cmd: Sequence[str], what: str, cwd: Path | None = None) -> None:
    p = subprocess.run(list(cmd), cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                       check=False)
    if p.returncode != 0:
        raise ImageError(f"{what} failed ({p.returncode}): {' '.join(cmd)}\n{p.stdout.strip()[-4000:]}")


def _pip(*args: str) -> list[str]:
    return [sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input", "-q", *args]


def _build_wheel(tmp: Path) -> Path:
    """The wheel of a copy of the Dockerfiles' build context (pyproject.toml, README.md,
    hatch_build.py, hack/gen_proto.py, operator/ without generated files): ``pip wheel``, whose
    build hook (hatch_build.py) generates the gRPC stubs into the wheel, as ``pip install .`` in
    the Dockerfiles does."""
    src = tmp / "src"
    (src / "hack").mkdir(parents=True)
    for name in ("pyproject.toml", "README.md", HATCH_BUILD.name):
        shutil.copy2(REPO_ROOT / name, src / name)
    shutil.copy2(GEN_PROTO, src / "hack" / "gen_proto.py")
    shutil.copytree(REPO_ROOT / "operator", src / "operator",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*_pb2.py", "*_pb2_grpc.py", "*.egg-info"))
    out = tmp / "wheel"
    _run(_pip("wheel", "--no-deps", "-w", str(out), f"{src}/"), "pip wheel (hatchling, grpcio-tools from PyPI)")
    wheels = sorted(out.glob("kvgpu-*.whl"))
    if len(wheels) != 1:
        raise ImageError(f"pip wheel gave {wheels}")
    return wheels[0]


def _fix_scripts(target: Path, bindir: Path) -> list[str]:
    """Move ``pip install --target``'s ``bin/`` into the venv's, pointing each script at the
    venv's python (pip wrote this build's interpreter into the shebangs)."""
    moved: list[str] = []
    src = target / "bin"
    if not src.is_dir():
        return moved
    bindir.mkdir(parents=True, exist_ok=True)
    for f in sorted(src.iterdir()):
        data = f.read_bytes()
        if data.startswith(b"#!") and b"python" in data.split(b"\n", 1)[0]:
            data = b"#!" + f"{VENV}/bin/python".encode() + b"\n" + data.split(b"\n", 1)[1]
        (bindir / f.name).write_bytes(data)
        (bindir / f.name).chmod(0o755)
        moved.append(f.name)
    shutil.rmtree(src)
    return moved


def _compile(root: Path, tree: Path) -> None:
    """Byte-compile ``root/tree`` for the image: paths as the image sees them, unchecked-hash."""
    _run([sys.executable, "-m", "compileall", "-q", "-j", "0", "--invalidation-mode", "unchecked-hash",
          "-s", str(root), "-p", "/", str(root / tree)], f"compileall {tree}")


def _elfs(root: Path) -> list[Path]:
    return [p for p in root.rglob("*.so*") if p.is_file() and not p.is_symlink()
            and p.read_bytes()[:4] == b"\x7fELF"]


def _host_libs(paths: Iterable[Path], staging: Path) -> list[str]:
    """The ``ldd`` closure of ``paths`` minus what lies in ``staging`` (wheels' bundled
    ``*.libs`` come with their wheels)."""
    return sorted(lib for lib in images._ldd(paths) if not lib.startswith(str(staging)))


def _layer_file(root: Path, out: Path, owners: dict[str, tuple[int, int]] | None = None) -> tuple[str, int]:
    data = images.layer_from_dir(root, owners)
    out.write_bytes(data)
    return hashlib.sha256(data).hexdigest(), len(data)


def write_layered_archive(out: Path, layers: Sequence[tuple[str, Path]],
                          configs: Sequence[tuple[ImageConfig, Sequence[int]]]) -> None:
    """A ``docker save``-style tarball of several layers (``(sha256, file)``) and image configs,
    each naming its layers by index (bottom first); layers shared by images are stored once."""
    tmp = out.with_suffix(".tmp")
    manifest = []
    with tarfile.open(tmp, "w", format=tarfile.PAX_FORMAT) as t:
        for sha, path in layers:
            ti = tarfile.TarInfo(f"{sha}/layer.tar")
            ti.size, ti.mtime, ti.mode = path.stat().st_size, 0, 0o644
            with path.open("rb") as f:
                t.addfile(ti, f)
        for cfg, idx in configs:
            doc = cfg.to_json(f"sha256:{layers[idx[0]][0]}")
            doc["rootfs"]["diff_ids"] = [f"sha256:{layers[i][0]}" for i in idx]
            doc["history"] = [{"created": "1970-01-01T00:00:00Z", "created_by": "kvgpu.devcluster.productimages"}
                              for _ in idx]
            cb = json.dumps(doc, sort_keys=True).encode()
            csha = hashlib.sha256(cb).hexdigest()
            for arc, data in ((f"{csha}.json", cb),):
                ti = tarfile.TarInfo(arc)
                ti.size, ti.mtime, ti.mode = len(data), 0, 0o644
                t.addfile(ti, io.BytesIO(data))
            manifest.append({"Config": f"{csha}.json", "RepoTags": [cfg.ref],
                             "Layers": [f"{layers[i][0]}/layer.tar" for i in idx]})
        data = json.dumps(manifest).encode()
        ti = tarfile.TarInfo("manifest.json")
        ti.size, ti.mtime, ti.mode = len(data), 0, 0o644
        t.addfile(ti, io.BytesIO(data))
    tmp.replace(out)


def image_configs() -> tuple[ImageConfig, ImageConfig]:
    """(operator, agent) configs: entrypoint, cmd and user of the Dockerfiles."""
    op, ag = refs()
    return (ImageConfig(op, entrypoint=["kvgpu"], cmd=["operator"], env=PRODUCT_ENV, user=OPERATOR_USER),
            ImageConfig(ag, entrypoint=["kvgpu"], cmd=["agent"], env=PRODUCT_ENV, user=AGENT_USER))


# ----- the recipe -------------------------------------------------------------------------------
def build_product_images() -> BuiltImage:
    """Build (or find in the cache) the archive with ``kvgpu-operator`` and ``kvgpu-agent``."""
    if not SHIM_SO.exists():
        raise ImageError(f"{SHIM_SO} not built: make shim")
    exe, libpython, stdlib = _interpreter()
    busybox = images._busybox()
    pins = runtime_pins()
    op_cfg, ag_cfg = image_configs()
    key = images._hash_inputs([RECIPE_VERSION, PYPROJECT, REPO_ROOT / "README.md", GEN_PROTO, HATCH_BUILD,
                               _source_digest(PACKAGE_DIR), SHIM_SO, exe, *([libpython] if libpython else []),
                               sys.version, busybox, "\n".join(pins), json.dumps([op_cfg.to_json(""),
                                                                                 ag_cfg.to_json("")])])

    def build(tmp: Path, archive: Path) -> None:
        t0 = time.monotonic()
        times: dict[str, float] = {}

        def step(name: str, since: float) -> float:
            now = time.monotonic()
            times[name] = round(now - since, 1)
            _say(f"  {name}: {times[name]:.1f} s")
            return now

        t = t0
        _say(f"  wheel of kvgpu {version()} (pip wheel, hatch_build.py) ...")
        wheel = _build_wheel(tmp)
        t = step("wheel", t)

        deps = tmp / "deps"
        site_rel = SITE.lstrip("/")
        _say(f"  {len(pins)} pinned runtime dependencies (pip install --target --no-deps) ...")
        (tmp / "pins.txt").write_text("\n".join(pins) + "\n")
        _run(_pip("install", "--no-deps", "--no-compile", "--target", str(deps / site_rel), "-r",
                  str(tmp / "pins.txt")), "pip install (runtime dependencies)")
        _fix_scripts(deps / site_rel, deps / VENV.lstrip("/") / "bin")
        venv = deps / VENV.lstrip("/")
        (venv / "pyvenv.cfg").write_text(f"home = /usr/local/bin\ninclude-system-site-packages = false\n"
                                         f"version = {sys.version.split()[0]}\n")
        for name in ("python", "python3", PY):
            (venv / "bin" / name).symlink_to(f"/usr/local/bin/{PY}")
        _compile(deps, Path(site_rel))
        t = step("deps", t)

        pkg = tmp / "kvgpu"
        _run(_pip("install", "--no-deps", "--no-compile", "--target", str(pkg / site_rel), str(wheel)),
             "pip install (kvgpu wheel)")
        scripts = _fix_scripts(pkg / site_rel, pkg / VENV.lstrip("/") / "bin")
        if "kvgpu" not in scripts:
            raise ImageError(f"the kvgpu wheel installed no kvgpu script (got {scripts})")
        _compile(pkg, Path(site_rel))
        t = step("kvgpu", t)

        shim = tmp / "shim"
        (shim / Path(SHIM_IN_IMAGE).parent.relative_to("/")).mkdir(parents=True)
        shutil.copy2(SHIM_SO, shim / SHIM_IN_IMAGE.lstrip("/"))

        root = tmp / "runtime"
        for d in ("usr/bin", "usr/sbin", "usr/lib", "usr/lib64", "usr/local/bin", "usr/local/lib", "etc", "proc",
                  "sys", "dev", "root", "run", "var/run", "var/cache/ldconfig"):
            (root / d).mkdir(parents=True, exist_ok=True)
        for top in ("bin", "sbin", "lib", "lib64"):  # merged /usr, as on the host
            (root / top).symlink_to(f"usr/{top}")
        (root / "tmp").mkdir()
        (root / "tmp").chmod(0o1777)
        shutil.copy2(busybox, root / "usr/bin/busybox")
        applets = subprocess.run([str(busybox), "--list"], capture_output=True, text=True, check=True).stdout.split()
        for a in applets:
            if a != "busybox":
                (root / "usr/bin" / a).symlink_to("busybox")
        shutil.copy2(exe, root / "usr/local/bin" / PY)
        for name in ("python3", "python"):
            (root / "usr/local/bin" / name).symlink_to(PY)
        if libpython:
            shutil.copy2(libpython, root / "usr/local/lib" / libpython.name)
        ext = images._copy_tree(stdlib, root / "usr/local/lib" / PY, STDLIB_SKIP)
        for f in (root / "usr/local/lib" / PY / "lib-dynload").glob("_tkinter*"):  # tkinter is left out
            f.unlink()
        ext = [e for e in ext if not e.name.startswith("_tkinter")]
        _compile(root, Path("usr/local/lib") / PY)
        libs = _host_libs([exe, *([libpython] if libpython else []), *ext, *_elfs(deps), *_elfs(pkg),
                           *_elfs(shim)], tmp)
        libs = [lib for lib in libs if not libpython or os.path.realpath(lib) != os.path.realpath(libpython)]
        for lib in libs:
            images._copy_host_path(lib, root)
        (root / "etc/ld.so.conf").write_text("/usr/local/lib\n/usr/lib/x86_64-linux-gnu\n/usr/lib64\n")
        ld = subprocess.run(["ldconfig", "-r", str(root)], capture_output=True, text=True, check=False)
        if ld.returncode != 0:
            raise ImageError(f"ldconfig -r {root} failed (needs root for chroot): {ld.stderr.strip()}")
        # as python:*-slim (root, nobody) plus the operator's user, as Dockerfile.operator adds it
        (root / "etc/passwd").write_text("root:x:0:0:root:/root:/bin/sh\n"
                                         "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n"
                                         f"{NONROOT}:x:65532:65532:kvgpu:/nonexistent:/usr/sbin/nologin\n")
        (root / "etc/group").write_text(f"root:x:0:\nnogroup:x:65534:\n{NONROOT}:x:65532:\n")
        t = step("runtime", t)

        layer_dir = tmp / "layers"
        layer_dir.mkdir()
        layers: list[tuple[str, Path]] = []
        sizes: dict[str, int] = {}
        for name, tree in (("runtime", root), ("deps", deps), ("kvgpu", pkg), ("shim", shim)):
            sha, n = _layer_file(tree, layer_dir / f"{name}.tar")
            layers.append((sha, layer_dir / f"{name}.tar"))
            sizes[name] = n
        write_layered_archive(archive, layers, [(op_cfg, (0, 1, 2)), (ag_cfg, (0, 1, 2, 3))])
        step("layers+archive", t)
        times["total"] = round(time.monotonic() - t0, 1)
        sizes["archive"] = archive.stat().st_size
        (archive.parent / "build.json").write_text(json.dumps(
            {"refs": list(refs()), "pins": pins, "wheel": wheel.name, "layerBytes": sizes, "seconds": times,
             "hostLibs": libs}, indent=2))
        _say(f"  done in {times['total']:.1f} s: " + ", ".join(f"{k} {v / 2**20:.0f} MiB" for k, v in sizes.items()))

    img = images._cached("product", key, refs(), build)
    _prune(img.archive.parent)
    return img


def _prune(keep: Path, min_age_s: float = 600.0) -> None:
    """Remove earlier product builds (~330 MiB each) that nothing touched for ``min_age_s``."""
    for d in keep.parent.glob("product-*"):
        if d != keep and d.is_dir() and time.time() - d.stat().st_mtime > min_age_s:
            shutil.rmtree(d, ignore_errors=True)


def build_info(img: BuiltImage) -> dict[str, object]:
    """What :func:`build_product_images` recorded (layer sizes, seconds per step, pins)."""
    f = img.archive.parent / "build.json"
    return dict(json.loads(f.read_text())) if f.exists() else {}


def dockerfile_config(path: Path) -> dict[str, object]:
    """ENTRYPOINT, CMD and USER of the final stage of a Dockerfile (exec form only)."""
    out: dict[str, object] = {}
    for line in path.read_text().splitlines():
        m = re.match(r"^(ENTRYPOINT|CMD|USER)\s+(.*)$", line.strip())
        if m:
            out[m.group(1)] = json.loads(m.group(2)) if m.group(1) != "USER" else m.group(2).strip()
    return out


if __name__ == "__main__":  # python -m kvgpu.devcluster.productimages: build (or find) them
    img = build_product_images()
    print(img.archive, *img.refs)


# ----- kube-scheduler ---------------------------------------------------------------------------
def build_scheduler_image(bin_dir: Path) -> BuiltImage:
    """``kvgpu.local/kube-scheduler:<version>``: the ktp multi-call binary of ``bin_dir`` (static,
    hack/ktp) at ``/usr/local/bin/ktp`` with ``kube-scheduler`` linked to it, the command that
    the chart's templates/scheduler.yaml runs; the version is the binary's (``--version``). One layer,
    no shell; cached like the others."""
    ktp = Path(os.path.realpath(bin_dir / "ktp"))
    p = subprocess.run([str(bin_dir / "kube-scheduler"), "--version"], capture_output=True, text=True, check=False)
    m = re.search(r"v\d+\.\d+\.\d+\S*", p.stdout)
    if p.returncode != 0 or not m:
        raise ImageError(f"{bin_dir}/kube-scheduler --version gave no version: {p.stdout}{p.stderr}")
    ref = f"kvgpu.local/kube-scheduler:{m.group(0)}"
    cfg = ImageConfig(ref, env=("PATH=/usr/local/bin:/usr/bin:/bin",), user="65532:65532")
    key = images._hash_inputs([RECIPE_VERSION, ktp, json.dumps(cfg.to_json(""))])

    def build(tmp: Path, archive: Path) -> None:
        root = tmp / "root"
        (root / "usr/local/bin").mkdir(parents=True)
        (root / "tmp").mkdir()
        (root / "tmp").chmod(0o1777)
        shutil.copy2(ktp, root / "usr/local/bin/ktp")
        (root / "usr/local/bin/kube-scheduler").symlink_to("ktp")
        images.write_docker_archive(archive, images.layer_from_dir(root), [cfg])

    return images._cached("kube-scheduler", key, (ref,), build)
