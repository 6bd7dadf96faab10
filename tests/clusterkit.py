"""Small helpers for cluster tests: free ports, waiting for a listener, stopping a process a
test started, collecting log records, and applying cluster-scoped objects for the length of a
block."""

from __future__ import annotations

import json
import logging
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_port(host: str, port: int, timeout: float = 30.0) -> None:
    """Wait until something accepts TCP connections at ``host:port``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, port), timeout=1):
                return
        except OSError:
            time.sleep(0.1)
    raise TimeoutError(f"nothing listens at {host}:{port} after {timeout:.0f} s")


def stop_process(proc: subprocess.Popen[Any] | None) -> None:
    """End a process a test started (SIGTERM, then SIGKILL after 20 s) and reap it; ``None`` or
    an already ended one is left as it is."""
    if proc is not None and proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class CollectRecords(logging.Handler):
    def __init__(self, records: list[logging.LogRecord]) -> None:
        super().__init__(logging.DEBUG)
        self.records = records

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@contextmanager
def temporarily_applied(cluster: Any, objects: list[dict[str, Any]], settle_s: float = 2.0) -> Iterator[None]:
    """``kubectl apply`` cluster-scoped ``objects`` for the block, then put back what was there
    before (replaced as it was, or deleted if it did not exist) — e.g. our own webhook
    configurations while a session-wide operator has its own under the same names. After
    putting objects back it waits ``settle_s`` (the API server reloads webhooks asynchronously)."""
    saved: list[tuple[dict[str, Any], dict[str, Any] | None]] = []
    for obj in objects:
        p = cluster.kubectl("get", obj["kind"].lower(), obj["metadata"]["name"], "-o", "json", check=False)
        saved.append((obj, json.loads(p.stdout) if p.returncode == 0 else None))
    try:
        for obj in objects:
            cluster.kubectl("apply", "-f", "-", input=json.dumps(obj))
        yield
    finally:
        for obj, old in saved:
            if old is None:
                cluster.kubectl("delete", obj["kind"].lower(), obj["metadata"]["name"], "--ignore-not-found",
                                check=False)
            else:
                for k in ("resourceVersion", "uid", "creationTimestamp", "generation", "managedFields"):
                    old["metadata"].pop(k, None)
                cluster.kubectl("replace", "-f", "-", input=json.dumps(old), check=False)
        if any(old is not None for _, old in saved):
            time.sleep(settle_s)
