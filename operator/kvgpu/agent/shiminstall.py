"""Install the shim on the host: immutable, version-named files and an atomic switch.

Layout under ``host_dir`` (default :data:`kvgpu.core.keys.HOST_SHIM_DIR`)::

    libvgpu.so.<version>            read-only (0444), never rewritten while in use
    libvgpu.so.<version>-<sha12>    only when <version> was rebuilt while the old one was in use
    libvgpu.so -> libvgpu.so.<...>  relative symlink, switched with rename(2)

and ``preload_file`` (default :data:`kvgpu.core.keys.HOST_PRELOAD_FILE`), read-only, holding the
in-container path of the library (:data:`kvgpu.core.keys.CONTAINER_SHIM_LIB`).

Every write goes to a temporary file in the same directory, is fsynced, made read-only and then
renamed over the target, so no reader ever sees a partial file. A file that a running process
maps or a container bind-mounts (see :func:`in_use`) is never replaced: a rebuild with the same
version but different bytes is written beside it with a content suffix. The device plugin mounts
the file the symlink resolves to at container creation, so a container keeps its library for its
whole life whatever is installed later.

The checks read ``/proc/*/maps`` and ``/proc/*/mountinfo``; in a DaemonSet the agent needs
``hostPID: true`` to see other containers' processes.
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
    ``replaced`` (same version, new bytes, old file not in use), ``beside`` (same version, new
    bytes, old file in use: new file with a content suffix). ``path`` is the file the
    ``libvgpu.so`` link now points at; ``switched`` says whether the link changed.
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
    is_in_use: Callable[[Path], bool] = in_use,
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
            elif is_in_use(target):
                target = d / f"{FILE_PREFIX}{version}-{digest[:12]}"
                action = "unchanged" if target.exists() and sha256_file(target) == digest else "beside"
            else:
                action = "replaced"
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


def prune_shims(
    host_dir: str | os.PathLike[str] = keys.HOST_SHIM_DIR,
    keep: int = 2,
    is_in_use: Callable[[Path], bool] = in_use,
) -> list[Path]:
    """Delete old version files that are neither current, among the ``keep`` newest, nor in use.

    Returns the removed paths. Never raises for a file that vanished meanwhile.
    """
    d = Path(host_dir)
    try:
        current = os.readlink(d / LINK_NAME)
    except OSError:
        current = ""
    files = sorted(
        (p for p in d.glob(FILE_PREFIX + "*") if p.is_file() and not p.is_symlink()),
        key=lambda p: p.stat().st_mtime,
        reverse=True,
    )
    removed = []
    for p in files[keep:]:
        if p.name == current or is_in_use(p):
            continue
        with contextlib.suppress(FileNotFoundError):
            p.unlink()
            removed.append(p)
    return removed
