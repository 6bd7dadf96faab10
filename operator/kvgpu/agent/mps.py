"""The MPS backend's node side: one MPS control daemon per card of an ``mps`` pool, and what a
sliced container needs to be its client.

A card whose pool has ``mode: mps`` gets its own ``nvidia-cuda-mps-control -d``, started with
``CUDA_VISIBLE_DEVICES=<UUID>`` and private directories under the host path
``<root>/<UUID>/`` (``pipe/``: the control socket clients connect to; ``log/``: the daemon's and
its servers' logs); ``root`` is :data:`kvgpu.core.keys.HOST_MPS_ROOT`. One daemon per card keeps
an MPS server's fault (a client's fatal fault ends the server and every co-tenant's work on it)
on that card, and lets a card join or leave the pool alone.

The daemon is detached from the agent (its own session, no inherited descriptors, ``-d`` forks
it away), so an agent that restarts in the same host namespaces finds it by its pipe and reuses
it. Liveness is asked through the pipe (``echo get_server_list | nvidia-cuda-mps-control`` with
the card's ``CUDA_MPS_PIPE_DIRECTORY``): an answer with exit status 0 = alive. A dead daemon (no
answer) is started again; a card that left the mps pool (or the node) gets ``quit``.

Clients (the device plugin's ``Allocate`` for a claim with ``mode=mps``; the shim forces the same
values from the claim file, so a tenant's own env cannot lift them): the card's pipe directory
mounted read-only on :data:`kvgpu.core.keys.CONTAINER_MPS_DIR` with ``CUDA_MPS_PIPE_DIRECTORY``
pointing there, ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` = the claim's cores (0 = 100) and
``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=<MiB>M`` (the client sees one device: the daemon's).

Pure core: paths, command lines, env, the plan; :class:`MpsDaemons` is the thin adapter that runs
the commands (``runner`` replaceable in tests, which put a fake ``nvidia-cuda-mps-control`` on
``PATH``).
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kvgpu.core import keys
from kvgpu.core.claimstr import ClaimString
from kvgpu.core.inventory import Card

log = logging.getLogger(__name__)

CONTROL = "nvidia-cuda-mps-control"
#: MPS on Volta and later serves at most this many clients per server (per card here); the
#: same as kvgpu.api.pools.MPS_MAX_CLIENTS (this module imports only the standard library and
#: kvgpu.core, so it runs on a bare GPU machine: bench/gpu/mps_check.sh).
MAX_CLIENTS = 48


# --------------------------------------------------------------------------- pure core


def card_dir(root: str | Path, uuid: str) -> Path:
    return Path(root) / uuid


def pipe_dir(root: str | Path, uuid: str) -> Path:
    return card_dir(root, uuid) / "pipe"


def log_dir(root: str | Path, uuid: str) -> Path:
    return card_dir(root, uuid) / "log"


def daemon_env(root: str | Path, uuid: str, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of card ``uuid``'s control daemon (and of every command sent to it)."""
    env = dict(os.environ if base is None else base)
    for k in [k for k in env if k.startswith("CUDA_MPS_")]:
        del env[k]  # the agent's own settings must not leak into the daemon
    env["CUDA_VISIBLE_DEVICES"] = uuid
    env["CUDA_MPS_PIPE_DIRECTORY"] = str(pipe_dir(root, uuid))
    env["CUDA_MPS_LOG_DIRECTORY"] = str(log_dir(root, uuid))
    return env


def start_argv(control: str = CONTROL) -> list[str]:
    return [control, "-d"]


#: What is written to the control program's stdin for each action.
QUERY = "get_server_list\n"
QUIT = "quit\n"


def mps_cards(cards: Iterable[Card]) -> list[str]:
    """UUIDs of the cards that need a daemon: covered by an ``mps`` pool, not in MIG mode."""
    return [c.uuid for c in cards if c.slicing is not None and c.slicing.mode == "mps" and not c.mig_mode]


@dataclass(frozen=True)
class Plan:
    start: tuple[str, ...] = ()  # wanted, no daemon answers
    stop: tuple[str, ...] = ()  # a daemon answers, the card is no longer wanted
    keep: tuple[str, ...] = ()  # wanted and alive


def plan(wanted: Iterable[str], alive: Mapping[str, bool]) -> Plan:
    """What to do given the wanted cards and the liveness of each card directory found
    (``alive``: UUID -> whether its daemon answered)."""
    want = list(dict.fromkeys(wanted))
    return Plan(
        start=tuple(u for u in want if not alive.get(u, False)),
        stop=tuple(sorted(u for u, ok in alive.items() if ok and u not in want)),
        keep=tuple(u for u in want if alive.get(u, False)),
    )


def thread_percentage(cores: int) -> int:
    """A claim's cores as the MPS active thread percentage (0 = no limit = 100)."""
    return cores if 0 < cores < 100 else 100


def client_env(claim: ClaimString, container_pipe_dir: str = keys.CONTAINER_MPS_DIR) -> dict[str, str]:
    """The env that makes a container the MPS client its claim says. Device ordinals are the
    client's (one card per mps container: 0)."""
    return {
        "CUDA_MPS_PIPE_DIRECTORY": container_pipe_dir,
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": str(thread_percentage(claim.devices[0].cores)),
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": ",".join(
            f"{i}={d.memory_mib}M" for i, d in enumerate(claim.devices)
        ),
    }


# --------------------------------------------------------------------------- adapter

Runner = Callable[..., subprocess.CompletedProcess]


@dataclass
class MpsDaemons:
    """Keeps one control daemon per mps card alive under ``root`` (see the module docstring).

    ``control``: the control program (a name on ``PATH`` or a path). ``sync`` is blocking (it
    runs the control program); the agent calls it in a thread after every inventory and every
    ``interval_s``."""

    root: str = keys.HOST_MPS_ROOT
    control: str = CONTROL
    timeout_s: float = 5.0
    start_wait_s: float = 10.0
    runner: Runner = subprocess.run
    base_env: Mapping[str, str] | None = None
    started: dict[str, int] = field(default_factory=dict)  # UUID -> starts by this agent
    stopped: list[str] = field(default_factory=list)

    def _control(self) -> str:
        found = shutil.which(self.control)
        if found is None:
            raise FileNotFoundError(f"{self.control} not found (PATH or driver bin folder)")
        return found

    def _send(self, uuid: str, text: str) -> subprocess.CompletedProcess | None:
        try:
            return self.runner(
                [self._control()], input=text, env=daemon_env(self.root, uuid, self.base_env),
                capture_output=True, text=True, timeout=self.timeout_s, check=False,
            )
        except (OSError, subprocess.TimeoutExpired) as e:
            log.warning("MPS control of %s: %s", uuid, e)
            return None

    def alive(self, uuid: str) -> bool:
        """Whether card ``uuid``'s daemon answers through its pipe."""
        if not (pipe_dir(self.root, uuid) / "control").exists():
            return False
        r = self._send(uuid, QUERY)
        return r is not None and r.returncode == 0

    def found(self) -> list[str]:
        """Card directories under the root (daemons of this or an earlier agent)."""
        try:
            return sorted(p.name for p in Path(self.root).iterdir() if (p / "pipe").is_dir())
        except FileNotFoundError:
            return []

    def start(self, uuid: str) -> bool:
        """Start card ``uuid``'s daemon, detached; True once it answers."""
        pipe, logs = pipe_dir(self.root, uuid), log_dir(self.root, uuid)
        for d in (pipe, logs):
            d.mkdir(parents=True, exist_ok=True)
            d.chmod(0o755)
        # A dead daemon leaves its socket and lock: a new one cannot bind next to them.
        for stale in pipe.iterdir():
            if not stale.is_dir():
                stale.unlink(missing_ok=True)
        try:
            self.runner(
                start_argv(self._control()), env=daemon_env(self.root, uuid, self.base_env),
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                start_new_session=True, close_fds=True, timeout=self.timeout_s, check=False,
            )
        except (OSError, subprocess.TimeoutExpired) as e:
            log.error("cannot start the MPS control daemon of %s: %s", uuid, e)
            return False
        self.started[uuid] = self.started.get(uuid, 0) + 1
        deadline = time.monotonic() + self.start_wait_s
        while time.monotonic() < deadline:
            if self.alive(uuid):
                log.info("MPS control daemon of %s running (pipe %s)", uuid, pipe)
                return True
            time.sleep(0.1)
        log.error("MPS control daemon of %s started but does not answer (log: %s)", uuid, logs)
        return False

    def stop(self, uuid: str) -> bool:
        """``quit`` card ``uuid``'s daemon (it ends its servers); True when it answered."""
        r = self._send(uuid, QUIT)
        ok = r is not None and r.returncode == 0
        if ok:
            self.stopped.append(uuid)
            log.info("MPS control daemon of %s stopped (card left the mps pool)", uuid)
        return ok

    def sync(self, cards: Sequence[Card]) -> Plan:
        """Start the missing or dead daemons of the mps cards, stop those of other cards."""
        wanted = mps_cards(cards)
        alive = {u: self.alive(u) for u in dict.fromkeys([*self.found(), *wanted])}
        p = plan(wanted, alive)
        for u in p.start:
            if u in alive and (pipe_dir(self.root, u) / "control").exists():
                log.warning("MPS control daemon of %s does not answer: starting it again", u)
            self.start(u)
        for u in p.stop:
            self.stop(u)
        return p

    def stop_all(self) -> None:
        for u in self.found():
            if self.alive(u):
                self.stop(u)


__all__ = [
    "CONTROL",
    "MAX_CLIENTS",
    "MpsDaemons",
    "Plan",
    "client_env",
    "daemon_env",
    "mps_cards",
    "pipe_dir",
    "plan",
    "start_argv",
    "thread_percentage",
]
