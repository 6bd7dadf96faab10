"""Run a Kopf operator in a background thread against a test cluster.

    registry = kopf.OperatorRegistry()
    register_my_handlers(registry)
    with kopf_in_thread(registry, cluster.operator_kubeconfig, adjust=my_settings) as op:
        ...  # the operator runs; op.records holds what Kopf and the handlers logged

The operator gets its own event loop in its own thread, logs in with the given kubeconfig (no
global ``KUBECONFIG``), runs standalone (no peering) and cluster-wide. ``adjust`` changes the
:class:`kopf.OperatorSettings` before start (webhook server, posting, timeouts...). On exit the
stop flag is set and the thread joined; if Kopf does not stop in time the test fails loudly
rather than leaking a thread silently.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import kopf
import yaml


def connection_info(kubeconfig: Path) -> kopf.ConnectionInfo:
    """Credentials of the current context of a kubeconfig with inline (``*-data``) or file certs."""
    cfg = yaml.safe_load(kubeconfig.read_text())  # JSON is YAML
    ctx_name = cfg["current-context"]
    ctx = next(c["context"] for c in cfg["contexts"] if c["name"] == ctx_name)
    cluster = next(c["cluster"] for c in cfg["clusters"] if c["name"] == ctx["cluster"])
    user = next(u["user"] for u in cfg["users"] if u["name"] == ctx["user"])

    def data(d: dict[str, Any], key: str) -> bytes | None:
        return base64.b64decode(d[f"{key}-data"]) if f"{key}-data" in d else None

    return kopf.ConnectionInfo(
        server=cluster["server"],
        ca_data=data(cluster, "certificate-authority"),
        ca_path=cluster.get("certificate-authority"),
        certificate_data=data(user, "client-certificate"),
        certificate_path=user.get("client-certificate"),
        private_key_data=data(user, "client-key"),
        private_key_path=user.get("client-key"),
        token=user.get("token"),
        default_namespace=ctx.get("namespace"),
    )


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


class CollectRecords(logging.Handler):
    def __init__(self, records: list[logging.LogRecord]) -> None:
        super().__init__(logging.DEBUG)
        self.records = records

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@dataclass
class KopfThread:
    thread: threading.Thread
    stop_flag: threading.Event
    ready_flag: threading.Event
    records: list[logging.LogRecord] = field(default_factory=list)
    error: BaseException | None = None

    def messages(self, contains: str = "") -> list[str]:
        """Logged messages (formatted) that contain ``contains``."""
        out = []
        for r in list(self.records):
            try:
                msg = r.getMessage()
            except Exception:  # a bad format string in someone's log call
                msg = str(r.msg)
            if contains in msg:
                out.append(msg)
        return out


@contextmanager
def kopf_in_thread(
    registry: kopf.OperatorRegistry,
    kubeconfig: Path,
    *,
    adjust: Callable[[kopf.OperatorSettings], None] | None = None,
    namespaces: list[str] | None = None,
    memo: Any = None,
    ready_timeout: float = 60.0,
    stop_timeout: float = 30.0,
    log_level: int = logging.DEBUG,
) -> Iterator[KopfThread]:
    """Run ``registry``'s handlers in a Kopf operator in a thread while the block runs.

    ``namespaces``: serve only these (default: cluster-wide). ``memo``: Kopf's operator memo.
    A registry may be run again later (the login handler is added once, credentials replaced).
    """
    creds: dict[str, kopf.ConnectionInfo] | None = getattr(registry, "_kopfthread_creds", None)
    if creds is None:
        creds = {}
        registry._kopfthread_creds = creds  # type: ignore[attr-defined]

        @kopf.on.login(registry=registry, id="kopfthread-login")
        def _login(**_: Any) -> kopf.ConnectionInfo:
            return creds["info"]

    creds["info"] = connection_info(kubeconfig)

    settings = kopf.OperatorSettings()
    settings.posting.enabled = False  # tests read logs, not Events, unless adjust says otherwise
    if adjust is not None:
        adjust(settings)

    stop_flag, ready_flag = threading.Event(), threading.Event()
    state = KopfThread(thread=threading.Thread(), stop_flag=stop_flag, ready_flag=ready_flag)

    def run() -> None:
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(kopf.operator(
                registry=registry, settings=settings, standalone=True,
                clusterwide=not namespaces, namespaces=namespaces or (), memo=memo,
                stop_flag=stop_flag, ready_flag=ready_flag,
            ))
        except BaseException as e:  # reported to the test on exit
            state.error = e
        finally:
            loop.close()

    kopf_logger = logging.getLogger("kopf")
    old_level = kopf_logger.level
    handler = CollectRecords(state.records)
    kopf_logger.addHandler(handler)
    kopf_logger.setLevel(log_level)
    state.thread = threading.Thread(target=run, name="kopf-operator", daemon=True)
    state.thread.start()
    try:
        deadline = time.monotonic() + ready_timeout
        while not ready_flag.wait(0.1):
            if not state.thread.is_alive():
                raise RuntimeError(f"the Kopf operator exited before it was ready: {state.error!r}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the Kopf operator was not ready after {ready_timeout:.0f} s")
        yield state
    finally:
        stop_flag.set()
        state.thread.join(stop_timeout)
        kopf_logger.removeHandler(handler)
        kopf_logger.setLevel(old_level)
        if state.thread.is_alive():
            raise RuntimeError(f"the Kopf operator did not stop within {stop_timeout:.0f} s")


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
