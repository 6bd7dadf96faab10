"""Is the shim the agent installed still there, and does it load? Published on the Node as the
annotation ``kvgpu.io/shim`` (what ``kubectl vgpu doctor`` reads).

Annotation value (canonical JSON, keys sorted)::

    {"version": "0.4.0", "file": "libvgpu.so.0.4.0", "sha256": "<hex>", "loadable": true,
     "error": ""}

``loadable`` is true when the link ``<host_dir>/libvgpu.so`` resolves to a file whose SHA-256 is
the one installed and a fresh process can ``dlopen`` it with ``RTLD_NOW`` (every symbol
resolved, its constructors run, as the dynamic loader does for ``/etc/ld.so.preload`` in a
container); otherwise ``error`` says what is wrong (missing, changed, the loader's message). The
load check runs in a child process (the shim's constructors must not run in the agent) and only
when the file changed since the last check; the existence and digest checks run every time.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .shiminstall import LINK_NAME, sha256_file

LOAD_TIMEOUT_S = 10.0
_LOAD = "import ctypes, os, sys; ctypes.CDLL(sys.argv[1], mode=os.RTLD_NOW)"


def dlopen_error(path: Path, timeout_s: float = LOAD_TIMEOUT_S) -> str:
    """``""`` when a child process loads ``path`` with ``RTLD_NOW``, else the loader's last
    message line (e.g. ``...: file too short``) or ``timed out``."""
    try:
        p = subprocess.run([sys.executable, "-c", _LOAD, str(path)], capture_output=True, text=True,
                           timeout=timeout_s, check=False, env={"PATH": os.environ.get("PATH", "")})
    except subprocess.TimeoutExpired:
        return f"loading {path} timed out after {timeout_s:.0f} s"
    if p.returncode == 0:
        return ""
    lines = [ln for ln in (p.stderr or "").splitlines() if ln.strip()]
    return lines[-1].removeprefix("OSError: ") if lines else f"loading {path} failed (exit {p.returncode})"


@dataclass
class ShimCheck:
    """Checks the installed shim in ``host_dir`` against ``version`` / ``sha256`` (what
    :func:`~kvgpu.agent.shiminstall.install_shim` reported). :meth:`annotation` is the
    annotation's text; ``loader`` is replaceable in tests."""

    host_dir: str
    version: str
    sha256: str
    loader: Callable[[Path], str] = dlopen_error
    _loaded: tuple[str, int, int, str] | None = None  # (path, inode, mtime_ns, error) of the last load

    def status(self) -> dict[str, object]:
        link = Path(self.host_dir) / LINK_NAME
        out: dict[str, object] = {"version": self.version, "file": "", "sha256": self.sha256, "loadable": False,
                                  "error": ""}
        try:
            target = link.resolve(strict=True)
            st = target.stat()
        except (OSError, RuntimeError):
            out["error"] = f"{link} is missing" + ("" if not link.is_symlink() else
                                                  f" (the link points at {os.readlink(link)}, which is gone)")
            return out
        out["file"] = target.name
        try:
            digest = sha256_file(target)
        except OSError as e:
            out["error"] = f"{target} is unreadable: {e.strerror or e}"
            return out
        if digest != self.sha256:
            out["error"] = f"{target} changed since the agent installed it (sha256 {digest[:12]}, installed " \
                           f"{self.sha256[:12]})"
            return out
        key = (str(target), st.st_ino, st.st_mtime_ns)
        if self._loaded is None or self._loaded[:3] != key:
            self._loaded = (*key, self.loader(target))
        out["error"] = self._loaded[3]
        out["loadable"] = not self._loaded[3]
        return out

    def annotation(self) -> str:
        return json.dumps(self.status(), sort_keys=True, separators=(",", ":"))
