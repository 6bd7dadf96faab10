"""Child processes of the operator (admission workers, the claim-phase worker): started with
multiprocessing's ``spawn`` (no forked event loop or locks), ended with the operator.

``PR_SET_PDEATHSIG`` makes the kernel send SIGTERM to a child when the operator ends, even by
SIGKILL, so no child outlives it and keeps serving or writing (prctl(2))."""

from __future__ import annotations

import asyncio
import ctypes
import multiprocessing
import os
import signal
from collections.abc import Callable, Coroutine
from multiprocessing.process import BaseProcess
from typing import Any

PR_SET_PDEATHSIG = 1
PR_SET_NAME = 15


def die_with_parent(name: str = "", parent: int = 0) -> None:
    """In a child: ask the kernel for SIGTERM when the parent ends, and name the process
    (``/proc/<pid>/comm``, what ``top`` shows; 15 bytes) — Linux; a no-op elsewhere. With
    ``parent`` (the PID that started us): exit at once if it is already gone, since a parent
    that died before the request was made sends no signal (seen: an operator stopped while its
    child was still starting left the child running)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
        if name:
            libc.prctl(PR_SET_NAME, ctypes.c_char_p(name.encode()[:15]), 0, 0, 0)
    except (OSError, AttributeError):
        pass
    if parent and os.getppid() != parent:
        os._exit(0)


def _child(target: Callable[..., None], args: tuple[Any, ...], name: str, parent: int) -> None:
    die_with_parent(name, parent)
    target(*args)


def run_loop(coro: Coroutine[Any, Any, None]) -> None:
    """Run ``coro`` on uvloop (libuv's event loop: cheaper sockets and TLS, ~15 % of the
    operator's CPU during bursts) when it is installed, else on asyncio's default loop."""
    try:
        import uvloop
    except ImportError:
        asyncio.run(coro)
        return
    uvloop.run(coro)


def run_child(coro: Coroutine[Any, Any, None]) -> None:
    """In a child: ignore the terminal's SIGINT (the operator's Ctrl-C stops it through the
    operator) and :func:`run_loop` ``coro``."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    run_loop(coro)


def spawn(target: Callable[..., None], args: tuple[Any, ...], name: str) -> BaseProcess:
    """Start ``target(*args)`` in a new interpreter (``spawn``; daemon, so the operator's exit
    path also ends it), named ``name`` and ended with this process (:func:`die_with_parent`).
    ``target`` must be a module-level function."""
    p = multiprocessing.get_context("spawn").Process(
        target=_child, args=(target, args, name[:15], os.getpid()), name=name, daemon=True)
    p.start()
    return p


def stop(procs: list[BaseProcess], timeout_s: float = 5.0) -> None:
    """SIGTERM, wait up to ``timeout_s``, then SIGKILL what is left."""
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(timeout_s)
        if p.is_alive():
            p.kill()
            p.join(timeout_s)
