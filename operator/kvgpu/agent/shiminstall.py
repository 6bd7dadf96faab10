"""Install the shim on the host: immutable, content-named files and an atomic switch.

Layout under ``host_dir`` (default :data:`kvgpu.core.keys.HOST_SHIM_DIR`)::

    libvgpu.so.<version>            read-only (0444), never rewritten
    libvgpu.so.<version>-<sha12>    a rebuild of <version> with other bytes, beside the first
    libvgpu.so -> libvgpu.so.<...>  relative symlink, switched with rename(2)

and ``preload_file`` (default :data:`kvgpu.core.keys.HOST_PRELOAD_FILE`), read-only, holding the
in-container path of the library (:data:`kvgpu.core.keys.CONTAINER_SHIM_LIB`).

**A file name never gets other bytes.** Every write goes to a temporary file in the same
directory, is fsynced, made read-only and renamed to a name that did not exist (or held the same
bytes), so no reader sees a partial file and no mapped file is ever changed: a process that maps
``libvgpu.so.<x>`` keeps exactly those bytes, whatever is installed later. This holds without
looking at other processes, which the agent cannot do with its capabilities dropped.

**Old files go only when nothing refers to them.** The device plugin records, at ``Allocate``,
which file a container was served: ``<region root>/<pod UID>/<container>.shim``
(:func:`record_shim_use`; beside the container's region directory, outside what the container
mounts, and removed with the pod's region directory). :func:`prune_shims` keeps the current
file, every recorded one, the ``keep`` newest, and any that :func:`in_use` finds mapped or
bind-mounted (a best effort: it needs ``hostPID`` and the right to read other processes'
``/proc/<pid>/maps``, which a DaemonSet with ``capabilities: drop: [ALL]`` lacks).

With the device plugin's directory mount (``mounts=dir``), a process that a running
container starts after an upgrade loads the new file through the link; the device plugin's
``mounts=pinned`` mode bind-mounts the container's file instead.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kvgpu.core import keys

LINK_NAME = "libvgpu.so"
FILE_PREFIX = "libvgpu.so."
MODE = 0o444


class ShimInstallError(RuntimeError):
    """The shim could not be installed (source missing, directory not writable, bad version)."""


@dataclass(frozen=True)
class InstallResult:
    """What :func:`install_shim` did.

    ``action``: ``installed`` (new file), ``unchanged`` (identical file already there),
    ``beside`` (same version, other bytes: a new file with a content suffix; the old one stays
    as it is). ``path`` is the file the ``libvgpu.so`` link now points at; ``switched`` says
    whether the link changed.
    """

    path: Path
    version: str
    sha256: str
    action: str
    switched: bool


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _fsync_dir(d: Path) -> None:
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: Path, data: bytes, mode: int = MODE) -> None:
    """Write ``data`` to ``path`` via temp file + fsync + chmod + rename (+ directory fsync)."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
    _fsync_dir(path.parent)


def atomic_symlink(link: Path, target: str) -> bool:
    """Point ``link`` at ``target`` (relative name) atomically. Returns True if it changed."""
    with contextlib.suppress(OSError):
        if os.readlink(link) == target:
            return False
    tmp = link.with_name(f".{link.name}.link-{os.getpid()}")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)
    os.symlink(target, tmp)
    os.replace(tmp, link)
    _fsync_dir(link.parent)
    return True


def in_use(path: Path, proc: str = "/proc") -> bool:
    """True if any process maps ``path`` (same device and inode in ``/proc/<pid>/maps``) or has it
    bind-mounted (same device, mount root ending in its name, in ``/proc/<pid>/mountinfo``).

    Unreadable processes are skipped; a missing ``path`` is not in use.
    """
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    dev_maps = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}"
    dev_mnt = f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"
    ino = str(st.st_ino)
    suffix = "/" + path.name
    try:
        pids = [p for p in os.listdir(proc) if p.isdigit()]
    except OSError:
        return False
    seen_mnt_ns: set[str] = set()
    for pid in pids:
        base = os.path.join(proc, pid)
        try:
            with open(os.path.join(base, "maps")) as f:
                for line in f:
                    parts = line.split(None, 5)
                    if len(parts) >= 5 and parts[4] == ino and parts[3] == dev_maps:
                        return True
        except OSError:
            pass
        try:
            ns = os.readlink(os.path.join(base, "ns", "mnt"))
        except OSError:
            ns = pid
        if ns in seen_mnt_ns:
            continue
        seen_mnt_ns.add(ns)
        try:
            with open(os.path.join(base, "mountinfo")) as f:
                for line in f:
                    parts = line.split(None, 5)
                    if len(parts) >= 4 and parts[2] == dev_mnt and parts[3].endswith(suffix):
                        return True
        except OSError:
            pass
    return False


def install_shim(
    source: str | os.PathLike[str],
    version: str,
    host_dir: str | os.PathLike[str] = keys.HOST_SHIM_DIR,
    preload_file: str | os.PathLike[str] | None = keys.HOST_PRELOAD_FILE,
    container_lib: str = keys.CONTAINER_SHIM_LIB,
) -> InstallResult:
    """Install ``source`` as ``libvgpu.so.<version>`` in ``host_dir`` and switch the link to it.

    Also (re)writes ``preload_file`` when its content differs (``None`` skips it).
    Raises :class:`ShimInstallError` if ``source`` is unreadable, ``version`` is not a plain
    file-name part, or the directory cannot be written.
    """
    if not version or "/" in version or version.startswith("."):
        raise ShimInstallError(f"bad shim version {version!r}")
    src = Path(source)
    d = Path(host_dir)
    try:
        data = src.read_bytes()
    except OSError as e:
        raise ShimInstallError(f"shim source {src}: {e.strerror or e}") from e
    digest = hashlib.sha256(data).hexdigest()
    try:
        d.mkdir(parents=True, exist_ok=True)
        target = d / f"{FILE_PREFIX}{version}"
        action = "installed"
        if target.exists():
            if sha256_file(target) == digest:
                action = "unchanged"
            else:  # never other bytes under a name: a mapped file must stay what it was
                target = d / f"{FILE_PREFIX}{version}-{digest[:12]}"
                action = "unchanged" if target.exists() and sha256_file(target) == digest else "beside"
        if action == "unchanged":
            if (target.stat().st_mode & 0o777) != MODE:
                os.chmod(target, MODE)
        else:
            atomic_write(target, data)
        switched = atomic_symlink(d / LINK_NAME, target.name)
        if preload_file is not None:
            pf = Path(preload_file)
            want = (container_lib + "\n").encode()
            try:
                current = pf.read_bytes()
            except FileNotFoundError:
                current = None
            if current != want:
                pf.parent.mkdir(parents=True, exist_ok=True)
                atomic_write(pf, want)
    except OSError as e:
        raise ShimInstallError(f"installing the shim in {d}: {e}") from e
    return InstallResult(target, version, digest, action, switched)


SHIM_RECORD_SUFFIX = ".shim"


def record_shim_use(region_root: str | os.PathLike[str], pod_uid: str, container: str, shim_file: str) -> Path:
    """Record that ``container`` of pod ``pod_uid`` was served ``shim_file`` (a file name in the
    shim directory): ``<region_root>/<pod_uid>/<container>.shim``, read-only, written atomically.

    Raises ``ValueError`` for a pod UID, container or file name that is not one path component,
    ``OSError`` when it cannot be written. Returns the record's path.
    """
    for part in (pod_uid, container, shim_file):
        if not part or part in (".", "..") or "/" in part or "\0" in part:
            raise ValueError(f"not a path component: {part!r}")
    pod_dir = Path(region_root) / pod_uid
    pod_dir.mkdir(parents=True, exist_ok=True)
    path = pod_dir / f"{container}{SHIM_RECORD_SUFFIX}"
    atomic_write(path, (shim_file + "\n").encode())
    return path


def recorded_shims(region_root: str | os.PathLike[str] | None) -> set[str]:
    """The shim file names recorded by :func:`record_shim_use` under ``region_root`` (``None``:
    none). Unreadable records are skipped."""
    out: set[str] = set()
    if region_root is None:
        return out
    for rec in Path(region_root).glob(f"*/*{SHIM_RECORD_SUFFIX}"):
        with contextlib.suppress(OSError, UnicodeDecodeError):
            out.add(rec.read_text().strip())
    return out


def prune_shims(
    host_dir: str | os.PathLike[str] = keys.HOST_SHIM_DIR,
    keep: int = 2,
    is_in_use: Callable[[Path], bool] = in_use,
    region_root: str | os.PathLike[str] | None = None,
) -> list[Path]:
    """Delete old shim files that are neither current, among the ``keep`` newest, recorded for a
    container under ``region_root`` (:func:`recorded_shims`), nor :func:`in_use`.

    Returns the removed paths. Never raises for a file that vanished meanwhile.
    """
    d = Path(host_dir)
    try:
        current = os.readlink(d / LINK_NAME)
    except OSError:
        current = ""
    referenced = recorded_shims(region_root)
    files = sorted(
        (p for p in d.glob(FILE_PREFIX + "*") if p.is_file() and not p.is_symlink()),
        key=lambda p: p.stat().st_mtime,
        reverse=True,
    )
    removed = []
    for p in files[keep:]:
        if p.name == current or p.name in referenced or is_in_use(p):
            continue
        with contextlib.suppress(FileNotFoundError):
            p.unlink()
            removed.append(p)
    return removed
