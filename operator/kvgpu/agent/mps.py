"""The MPS backend's node side: one MPS control daemon per card of an ``mps`` pool, who owns
those daemons, and what a sliced container needs to be their client.

A card whose pool has ``mode: mps`` gets its own ``nvidia-cuda-mps-control -d``, started with
``CUDA_VISIBLE_DEVICES=<UUID>`` and private directories under the host path
``<root>/<UUID>/`` (``pipe/``: the sockets clients connect to; ``log/``: the daemon's and its
servers' logs); ``root`` is :data:`kvgpu.core.keys.HOST_MPS_ROOT`. One daemon per card keeps an
MPS server's fault (a client's fatal fault ends the server and every co-tenant's work on it) on
that card, and lets a card join or leave the pool alone.

**Who decides, who owns.** The agent knows the pools, so it decides: after every inventory it
writes the mps cards' UUIDs to ``<root>/wanted.json`` (:func:`write_wanted`, atomic, only on
change). The **owner** (:class:`MpsOwner`, ``kvgpu mps-daemons``; in the chart its own
DaemonSet, so the daemons live in its cgroup and an agent container restart or upgrade leaves
them running) reads that file every round, starts a wanted card's daemon that does not answer,
sends ``quit`` to one whose card is no longer wanted, and writes ``<root>/status.json``
(:func:`status_text`): the round's time and each card's liveness. A missing or unreadable
``wanted.json`` changes nothing (a fresh host path never quits daemons). One owner at a time: it
holds ``<root>/owner.lock`` (``flock``) for its life; a second one waits as a standby. Without a
separate owner the agent runs the same :class:`MpsOwner` rounds itself (``--mps-daemons=agent``:
a bare machine, the dev cluster).

Liveness is asked through the pipe (``echo get_server_list | nvidia-cuda-mps-control`` with the
card's ``CUDA_MPS_PIPE_DIRECTORY``): an answer with exit status 0 = alive. The daemon is
detached from its starter (its own session, no inherited descriptors, ``-d`` forks it away), so
a restarted owner process in the same container finds it by its pipe and reuses it.

Clients (the device plugin's ``Allocate`` for a claim with ``mode=mps``; the shim forces the
same values from the claim file, so a tenant's own env cannot lift them): refused unless the
owner's status, fresh, says the card's daemon answers (:func:`not_ready`); then the card's pipe
directory mounted read-only on :data:`kvgpu.core.keys.CONTAINER_MPS_DIR` with
``CUDA_MPS_PIPE_DIRECTORY`` pointing there, ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` = the claim's
cores (0 = 100) and ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=<MiB>M`` (the client sees one device:
the daemon's). A client must reach the daemon's ``control`` socket (CUDA's first step is to ask
the control daemon for a server), and a read-only mount does not stop ``connect(2)`` on a
socket, so a client can also send control commands (``quit``, ``terminate_client``,
``set_default_active_thread_percentage``...): MPS tenants must trust each other (docs/agent.md,
"What an MPS client can do to the daemon").

Pure core: paths, command lines, env, the plan, the wanted and status files; :class:`MpsDaemons`
runs the commands (``runner`` replaceable in tests, which put a fake ``nvidia-cuda-mps-control``
on ``PATH``), :class:`MpsOwner` the rounds.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import shutil
import socket
import subprocess
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

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


#: The files of ``root`` besides the card directories (see the module docstring).
WANTED_FILE = "wanted.json"
STATUS_FILE = "status.json"
LOCK_FILE = "owner.lock"
FORMAT_VERSION = 1


def wanted_text(uuids: Iterable[str]) -> str:
    """``wanted.json``: the cards that should have a daemon, as the agent decided."""
    return json.dumps({"version": FORMAT_VERSION, "cards": sorted(set(uuids))}, separators=(",", ":")) + "\n"


def parse_wanted(text: str) -> list[str] | None:
    """The wanted cards, or None when ``text`` is not a wanted file of this format (the owner
    then changes nothing)."""
    try:
        obj = json.loads(text)
    except ValueError:
        return None
    if not isinstance(obj, dict) or obj.get("version") != FORMAT_VERSION:
        return None
    cards = obj.get("cards")
    if not isinstance(cards, list) or not all(isinstance(u, str) and u and "/" not in u for u in cards):
        return None
    return list(dict.fromkeys(cards))


@dataclass(frozen=True)
class Status:
    """``status.json``: the owner's last round."""

    time: float  # wall clock (time.time()) of the round
    interval_s: float  # the owner's round period
    alive: Mapping[str, bool]  # card UUID -> its daemon answered in that round

    def stale_after(self) -> float:
        """How old a status may be before nobody is taken to be watching the daemons."""
        return 3 * self.interval_s + 10.0


def status_text(st: Status) -> str:
    return json.dumps({"version": FORMAT_VERSION, "time": round(st.time, 3), "intervalSeconds": st.interval_s,
                       "cards": {u: {"alive": a} for u, a in sorted(st.alive.items())}},
                      separators=(",", ":")) + "\n"


def parse_status(text: str) -> Status | None:
    try:
        obj = json.loads(text)
        if obj.get("version") != FORMAT_VERSION:
            return None
        return Status(float(obj["time"]), float(obj["intervalSeconds"]),
                      {str(u): bool(c["alive"]) for u, c in obj["cards"].items()})
    except (ValueError, TypeError, KeyError, AttributeError):
        return None


def not_ready(status: Status | None, uuid: str, now: float) -> str | None:
    """Why card ``uuid`` cannot take an MPS client now (None: it can), from the owner's status."""
    if status is None:
        return "no MPS daemon owner has reported (status.json missing or unreadable)"
    age = now - status.time
    if age > status.stale_after():
        return f"the MPS daemon owner's last report is {age:.0f} s old"
    if not status.alive.get(uuid, False):
        return "its MPS control daemon is not running"
    return None


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


def mps_control_program(control: str = CONTROL, driver_root: str | None = None) -> str:
    """The control program to run: ``control`` as given when it is a path, else the driver
    folder's ``bin/<control>`` when executable (the driver folder is usually not on ``PATH``),
    else ``control`` (looked up on ``PATH``)."""
    driver_bin = os.path.join(driver_root or "/usr/local/nvidia", "bin", control)
    if os.sep not in control and os.access(driver_bin, os.X_OK):
        return driver_bin
    return control

Runner = Callable[..., subprocess.CompletedProcess]


@dataclass
class MpsDaemons:
    """Keeps one control daemon per mps card alive under ``root`` (see the module docstring).

    ``control``: the control program (a path, or a name looked up at each use in ``driver_root``'s
    ``bin/``, then on ``PATH``: a driver that appears after the start is found). ``sync`` is
    blocking (it runs the control program); the agent calls it in a thread after every inventory
    and every ``interval_s``."""

    root: str = keys.HOST_MPS_ROOT
    control: str = CONTROL
    driver_root: str | None = None
    timeout_s: float = 5.0
    start_wait_s: float = 10.0
    runner: Runner = subprocess.run
    base_env: Mapping[str, str] | None = None
    started: dict[str, int] = field(default_factory=dict)  # UUID -> starts by this process
    stopped: list[str] = field(default_factory=list)
    last: dict[str, bool] = field(default_factory=dict)  # UUID -> alive after the last sync

    def _control(self) -> str:
        found = shutil.which(mps_control_program(self.control, self.driver_root))
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
        """Start card ``uuid``'s daemon, detached; True once it answers. False, starting none,
        while a daemon still accepts connections on the pipe (alive but slow to answer: removing
        its socket would orphan it and its MPS server beside a second daemon)."""
        pipe, logs = pipe_dir(self.root, uuid), log_dir(self.root, uuid)
        if listening(pipe / "control"):
            log.warning("MPS control daemon of %s accepts connections but did not answer: not starting "
                        "a second one", uuid)
            return False
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
        return self.sync_uuids(mps_cards(cards))

    def sync_uuids(self, wanted: Sequence[str]) -> Plan:
        """Start the missing or dead daemons of the ``wanted`` cards, stop those of other cards;
        ``self.last`` becomes each known card's liveness after the round."""
        alive = {u: self.alive(u) for u in dict.fromkeys([*self.found(), *wanted])}
        p = plan(wanted, alive)
        after = dict(alive)
        for u in p.start:
            if u in alive and (pipe_dir(self.root, u) / "control").exists():
                log.warning("MPS control daemon of %s does not answer: starting it again", u)
            after[u] = self.start(u)
        for u in p.stop:
            after[u] = not self.stop(u)
        self.last = after
        return p

    def stop_all(self) -> None:
        for u in self.found():
            if self.alive(u):
                self.stop(u)


def listening(sock: Path) -> bool:
    """Whether some process accepts connections on the unix socket ``sock`` (the kernel
    completes a connection to a listening socket even while its owner is busy or stopped; a dead
    owner's socket file refuses it)."""
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(1.0)
    try:
        s.connect(str(sock))
        return True
    except OSError:
        return False
    finally:
        s.close()


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(text)
    tmp.chmod(0o644)
    os.replace(tmp, path)


def write_wanted(root: str | Path, uuids: Iterable[str]) -> bool:
    """The agent's side: ``<root>/wanted.json`` = ``uuids``; True when it changed."""
    path = Path(root) / WANTED_FILE
    text = wanted_text(uuids)
    with contextlib.suppress(OSError):
        if path.read_text() == text:
            return False
    path.parent.mkdir(parents=True, exist_ok=True)
    _write_atomic(path, text)
    return True


def read_status(root: str | Path) -> Status | None:
    try:
        return parse_status((Path(root) / STATUS_FILE).read_text())
    except OSError:
        return None


def check_ready(root: str | Path, uuid: str, now: float | None = None) -> str | None:
    """The device plugin's check before it makes a container an MPS client of card ``uuid``:
    None when the owner's fresh status says the daemon answers and its socket is there."""
    why = not_ready(read_status(root), uuid, time.time() if now is None else now)
    if why is None and not (pipe_dir(root, uuid) / "control").exists():
        why = "its MPS control socket is missing"
    return why


@dataclass
class MpsOwner:
    """The owner of the daemons under ``daemons.root``: every round (``interval_s``) it reads the
    agent's ``wanted.json``, syncs the daemons and writes ``status.json``. Holds ``owner.lock``
    from its first successful round on; without it (another owner runs) a round does nothing."""

    daemons: MpsDaemons
    interval_s: float = 5.0
    clock: Callable[[], float] = time.time
    _lock: IO[str] | None = None
    standby_logged: bool = False

    @property
    def root(self) -> Path:
        return Path(self.daemons.root)

    def owns(self) -> bool:
        """Take ``owner.lock`` if it is free (kept until the process ends); True when held."""
        if self._lock is not None:
            return True
        self.root.mkdir(parents=True, exist_ok=True)
        f = open(self.root / LOCK_FILE, "a")  # held for the owner's life
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            f.close()
            if not self.standby_logged:
                log.info("another process owns the MPS daemons under %s: standing by", self.root)
                self.standby_logged = True
            return False
        os.set_inheritable(f.fileno(), False)
        self._lock = f
        log.info("owning the MPS daemons under %s", self.root)
        return True

    def wanted(self) -> list[str] | None:
        try:
            text = (self.root / WANTED_FILE).read_text()
        except FileNotFoundError:
            return None
        except OSError as e:
            log.warning("cannot read %s: %s", self.root / WANTED_FILE, e)
            return None
        got = parse_wanted(text)
        if got is None:
            log.warning("%s is not a wanted-cards file of format %d: changing nothing", self.root / WANTED_FILE,
                        FORMAT_VERSION)
        return got

    def round(self) -> Plan | None:
        """One round (blocking); None when another process owns the daemons."""
        if not self.owns():
            return None
        wanted = self.wanted()
        if wanted is None:  # nothing decided yet: keep what runs, start and quit nothing
            self.daemons.last = {u: self.daemons.alive(u) for u in self.daemons.found()}
            p = Plan(keep=tuple(u for u, a in self.daemons.last.items() if a))
        else:
            p = self.daemons.sync_uuids(wanted)
        _write_atomic(self.root / STATUS_FILE,
                      status_text(Status(self.clock(), self.interval_s, dict(self.daemons.last))))
        return p

    def release(self) -> None:
        if self._lock is not None:
            self._lock.close()
            self._lock = None

    def run(self, stop: Callable[[], bool] = lambda: False, reap: bool = False) -> None:
        """Rounds every ``interval_s`` until ``stop()``; the daemons stay when it returns.
        ``reap``: also collect exited children after each round (as a container's PID 1 the
        owner inherits every daemon ``-d`` detached, and must reap the dead ones)."""
        while not stop():
            try:
                self.round()
            except Exception:  # a full disk, a missing control program: retried next round
                log.exception("MPS daemon round failed")
            if reap:
                reap_children()
            deadline = time.monotonic() + self.interval_s
            while not stop() and time.monotonic() < deadline:
                time.sleep(min(0.2, self.interval_s))


def reap_children() -> int:
    """Collect every exited child (no waiting); how many."""
    n = 0
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return n
        if pid == 0:
            return n
        n += 1


__all__ = [
    "CONTROL",
    "MAX_CLIENTS",
    "MpsDaemons",
    "MpsOwner",
    "Plan",
    "Status",
    "check_ready",
    "client_env",
    "daemon_env",
    "mps_cards",
    "mps_control_program",
    "not_ready",
    "parse_status",
    "parse_wanted",
    "pipe_dir",
    "plan",
    "read_status",
    "reap_children",
    "start_argv",
    "status_text",
    "thread_percentage",
    "wanted_text",
    "write_wanted",
]
