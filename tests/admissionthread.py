"""Run kvgpu's admission server (:mod:`kvgpu.admission.server`) in a thread for a test, with
its log records collected::

    with admission_in_thread(port, cert, key, {"kvgpu-operator"}) as hooks:
        ...
        assert hooks.messages("mutate CREATE pod ns/name")

``extra`` adds routes to the application (e.g. a second test webhook on the same server).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from aiohttp import web
from clusterkit import CollectRecords, wait_port
from kvgpu.admission.server import make_app, serve


@dataclass
class AdmissionThread:
    records: list[logging.LogRecord] = field(default_factory=list)

    def messages(self, contains: str = "") -> list[str]:
        """Logged messages (formatted) that contain ``contains``."""
        return [m for r in list(self.records) if contains in (m := r.getMessage())]


@contextmanager
def admission_in_thread(
    port: int, certfile: str, keyfile: str, operators: Collection[str],
    extra: Callable[[web.Application], None] | None = None,
) -> Iterator[AdmissionThread]:
    state = AdmissionThread()
    app = make_app(operators)
    if extra is not None:
        extra(app)
    loop = asyncio.new_event_loop()
    stop = asyncio.Event()
    errors: list[BaseException] = []

    def run() -> None:
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(serve("127.0.0.1", port, certfile, keyfile, operators, stop=stop, app=app))
        except BaseException as e:  # reported on exit
            errors.append(e)
        finally:
            loop.close()

    logger = logging.getLogger("kvgpu.admission")
    handler = CollectRecords(state.records)
    old_level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    thread = threading.Thread(target=run, name="kvgpu-admission", daemon=True)
    thread.start()
    try:
        wait_port("127.0.0.1", port)
        yield state
    finally:
        if not loop.is_closed():
            loop.call_soon_threadsafe(stop.set)
        thread.join(30)
        logger.removeHandler(handler)
        logger.setLevel(old_level)
        if errors:
            raise RuntimeError(f"the admission server failed: {errors[0]!r}")
