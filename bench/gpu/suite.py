"""The workload suite (issue 21 item 4): every workload natively, under HAMi-core and under kvgpu.

    python3 bench/gpu/suite.py            (bench/gpu/suite.sh builds the libraries, then runs this)
    python3 bench/gpu/suite.py --report RESULTS.json [--out DIR]   re-render tables and plot
    python3 bench/gpu/suite.py --selftest [--out DIR]              the whole pipeline on fake
                                                                   workloads and a fake NVML

Environment: OUT (results folder), MODES (default "native hami kvgpu"), PARTS (default
"memory startup single group"), ONLY (workload or group ids, default all), SECS (measured
seconds per workload, default 4), SUITE_BUDGET_S with SUITE_T0 (skip what no longer fits, default
unlimited), BASELINE (results.json of an earlier run whose native runs serve when MODES has no
native), KVGPU_TREE (the kvgpu tree under test, default this one), KVGPU_LIB, HAMI_LIB, SUITE_CU
(the built libraries and driver-API program), SUITE_STATIC_SCHEDULE=1 (no agent Scheduler), PY.

MODES may include mps: the kvgpu shim with mode=mps claims, as MPS clients of one MPS control
daemon this run starts for the card (private pipe and log folders) and quits at the end.

Every run is one or more processes on the card alone. A sampler thread in this process (never
preloaded) reads NVML: nvmlDeviceGetSamples(GPU_UTILIZATION) — the driver's own record of the
fraction of each sample period in which a kernel ran, every sample period, so nothing between
polls is lost — for the card's busy share; nvmlDeviceGetProcessUtilization for each process's
share (co-tenants); nvmlDeviceGetComputeRunningProcesses_v3 at 20 Hz for per-process memory;
nvmlDeviceGetUtilizationRates at 10 Hz as a cross-check. kvgpu co-tenants get a schedule file
written with the node agent's own code (kvgpu.agent.schedule.layout/encode/write_schedule), as the
agent would write it for those claims on a real node.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import itertools
import json
import math
import os
import random
import shutil
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
# The kvgpu code under test: this tree, or a snapshot of it (KVGPU_TREE, e.g. `git archive HEAD`
# of shim/ and operator/kvgpu, so that a run measures committed code): its shim and its agent.
TREE = Path(os.environ.get("KVGPU_TREE") or ROOT)
sys.path.insert(0, str(TREE / "operator"))
from kvgpu.agent.schedule import Tenant, encode, layout, limited, write_schedule  # noqa: E402

HERE = Path(__file__).resolve().parent
MIB = 1 << 20

# ------------------------------------------------------------------------------------ the plan

# id, kind (suite_wl.py kind, or "spin1"/"spin10" for suite_cu spin), limits (percent of the card)
SINGLES: list[tuple[str, str, list[int]]] = [
    ("gpt", "gpt", [30, 50]),
    ("conv", "conv", [30]),
    ("infer", "infer", [30]),
    ("longk-sync1", "spin1", [10]),
    ("longk-sync10", "spin10", [10]),
    ("graphs", "graphs", [20]),
    ("compile", "compile", [30]),
    ("mm", "mm", []),  # native only: the co-tenants' baseline
]
# id, tenants (priority, cores; cores 0 = no compute limit), all running the mm workload. A 100 %
# limit is no limit in both shims (kvgpu gates 0 < cores < 100, HAMi-core SM_LIMIT < 100), so
# "priority 0 with no or 100 % limit" is one case.
GROUPS: list[tuple[str, list[tuple[int, int]]]] = [
    ("pair-30-70", [(1, 30), (1, 70)]),
    ("trio-20-30-50", [(1, 20), (1, 30), (1, 50)]),
    ("pair-70-50", [(1, 70), (1, 50)]),
    ("prio-a0none-b50", [(0, 0), (1, 50)]),
    ("prio-a0-70-b50", [(0, 70), (1, 50)]),
]
COMPUTE_MEM_MIB = 40000  # memory limit of every compute tenant (3 fit on the card)
GRAPH_LIMIT, HEAP_LIMIT, START_LIMIT = 1000, 3000, 8000
START_RACERS, START_ROUNDS = 8, 3


@dataclass
class Config:
    out: Path
    modes: list[str]
    parts: list[str]
    only: set[str]
    secs: float
    budget_s: float
    t0: float
    py: str
    kvgpu_lib: str
    hami_lib: str
    suite_cu: str
    uuid: str = ""
    sched_dir: str = ""
    mps_dir: str = ""  # mode mps: the card's MPS control daemon (pipe/, log/), as the agent runs it
    fake: bool = False
    baseline: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_env(cls, out: Path, fake: bool = False) -> Config:
        env = os.environ
        base: dict[str, Any] = {}
        if env.get("BASELINE"):
            base = json.loads(Path(env["BASELINE"]).read_text())
        return cls(
            out=out,
            modes=env.get("MODES", "native hami kvgpu").split(),
            parts=env.get("PARTS", "memory startup single group").split(),
            only=set(env.get("ONLY", "").split()),
            secs=float(env.get("SECS", "4")),
            budget_s=float(env.get("SUITE_BUDGET_S", "0") or 0),
            t0=float(env.get("SUITE_T0", "0") or 0) or time.time(),
            py=env.get("PY", sys.executable),
            kvgpu_lib=env.get("KVGPU_LIB", str(TREE / "shim/_build/libvgpu.so")),
            hami_lib=env.get("HAMI_LIB", ""),
            suite_cu=env.get("SUITE_CU", str(ROOT / "shim/_build/suite_cu")),
            fake=fake,
            baseline=base,
        )

    def left_s(self) -> float:
        return self.budget_s - (time.time() - self.t0) if self.budget_s else 1e9

    def wanted(self, ident: str) -> bool:
        return not self.only or ident in self.only or ident.split("@")[0] in self.only


# ------------------------------------------------------------------------------------ NVML


class NvmlSampler:
    """Reads NVML in a thread; never loaded under a shim (this process has no LD_PRELOAD)."""

    def __init__(self) -> None:
        self.dev: list[tuple[float, float]] = []  # (t, busy %) from nvmlDeviceGetSamples
        self.proc: list[tuple[int, float, float]] = []  # (pid, t, smUtil %)
        self.mem: list[tuple[float, int, float]] = []  # (t, pid, MiB)
        self.rates: list[tuple[float, float]] = []  # (t, gpu %) from nvmlDeviceGetUtilizationRates
        self.errors: dict[str, str] = {}
        self.clock_offset_s = 0.0
        self._offsets: list[float] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self.uuid = ""
        self.name = ""
        self.lib: Any = None
        self.h = ctypes.c_void_p()

    def start(self) -> None:
        lib = ctypes.CDLL("libnvidia-ml.so.1")
        self.lib = lib
        rc = lib.nvmlInit_v2()
        if rc:
            raise RuntimeError(f"nvmlInit_v2: {rc}")
        rc = lib.nvmlDeviceGetHandleByIndex_v2(0, ctypes.byref(self.h))
        if rc:
            raise RuntimeError(f"nvmlDeviceGetHandleByIndex_v2: {rc}")
        buf = ctypes.create_string_buffer(96)
        lib.nvmlDeviceGetUUID(self.h, buf, 96)
        self.uuid = buf.value.decode()
        with contextlib.suppress(AttributeError):
            lib.nvmlDeviceGetName(self.h, buf, 96)
            self.name = buf.value.decode()
        for fn in ("nvmlDeviceGetSamples", "nvmlDeviceGetProcessUtilization",
                   "nvmlDeviceGetComputeRunningProcesses_v3", "nvmlDeviceGetUtilizationRates"):
            if not hasattr(lib, fn):
                self.errors[fn] = "not exported"
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join(2)

    def _err(self, what: str, rc: int) -> None:
        self.errors.setdefault(what, f"rc {rc}")

    def _poll_samples(self, last: int) -> int:
        vt = ctypes.c_int()
        n = ctypes.c_uint(0)
        rc = self.lib.nvmlDeviceGetSamples(self.h, 1, ctypes.c_ulonglong(last), ctypes.byref(vt), ctypes.byref(n), None)
        if rc not in (0, 7) or n.value == 0:  # 7: INSUFFICIENT_SIZE (count set)
            if rc not in (0, 6, 7):  # 6: NVML_ERROR_NOT_FOUND (no new sample)
                self._err("nvmlDeviceGetSamples", rc)
            return last
        buf = (ctypes.c_ubyte * (16 * n.value))()
        rc = self.lib.nvmlDeviceGetSamples(self.h, 1, ctypes.c_ulonglong(last), ctypes.byref(vt), ctypes.byref(n), buf)
        if rc:
            if rc != 6:
                self._err("nvmlDeviceGetSamples", rc)
            return last
        now = time.time()
        raw = bytes(buf)
        got = []
        for i in range(n.value):
            ts, val = struct.unpack_from("<QQ", raw, 16 * i)
            if ts <= last:
                continue
            if vt.value == 0:
                v = struct.unpack("<d", struct.pack("<Q", val))[0]
            else:
                v = float(val & 0xFFFFFFFF) if vt.value in (1, 5) else float(val)
            got.append((ts / 1e6, v))
            last = max(last, ts)
        if got:
            self._offsets.append(now - max(t for t, _ in got))
            with self._lock:
                self.dev.extend(got)
        return last

    def _poll_proc(self, seen: set[tuple[int, int]]) -> None:
        # nvmlProcessUtilizationSample_t: pid u32, (pad), timeStamp u64, sm, mem, enc, dec u32
        # the first call (NULL buffer) sets the count; the H200 answered a fixed 64 with rc 7
        n = ctypes.c_uint(0)
        rc = self.lib.nvmlDeviceGetProcessUtilization(self.h, None, ctypes.byref(n), ctypes.c_ulonglong(0))
        if rc not in (0, 7) or n.value == 0:
            if rc not in (0, 6, 7):
                self._err("nvmlDeviceGetProcessUtilization", rc)
            return
        cap = n.value + 8
        buf = (ctypes.c_ubyte * (32 * cap))()
        n = ctypes.c_uint(cap)
        rc = self.lib.nvmlDeviceGetProcessUtilization(self.h, buf, ctypes.byref(n), ctypes.c_ulonglong(0))
        if rc:
            if rc not in (6,):
                self._err("nvmlDeviceGetProcessUtilization", rc)
            return
        raw = bytes(buf)
        got = []
        for i in range(min(n.value, cap)):
            pid, ts, sm = struct.unpack_from("<I4xQI", raw, 32 * i)
            if (pid, ts) in seen:
                continue
            seen.add((pid, ts))
            got.append((pid, ts / 1e6, float(sm)))
        with self._lock:
            self.proc.extend(got)

    def _poll_mem(self) -> None:
        cap = 64
        buf = (ctypes.c_ubyte * (24 * cap))()
        n = ctypes.c_uint(cap)
        rc = self.lib.nvmlDeviceGetComputeRunningProcesses_v3(self.h, ctypes.byref(n), buf)
        if rc:
            self._err("nvmlDeviceGetComputeRunningProcesses_v3", rc)
            return
        now, raw = time.time(), bytes(buf)
        got = []
        for i in range(min(n.value, cap)):
            pid, used = struct.unpack_from("<I4xQ", raw, 24 * i)
            if used < (1 << 62):  # NVML_VALUE_NOT_AVAILABLE is ULLONG_MAX
                got.append((now, pid, used / MIB))
        with self._lock:
            self.mem.extend(got)

    def _poll_rates(self) -> None:
        u = (ctypes.c_uint * 2)()
        rc = self.lib.nvmlDeviceGetUtilizationRates(self.h, u)
        if rc:
            self._err("nvmlDeviceGetUtilizationRates", rc)
            return
        with self._lock:
            self.rates.append((time.time(), float(u[0])))

    def _run(self) -> None:
        last, k = 0, 0
        seen: set[tuple[int, int]] = set()
        ok = {fn: fn not in self.errors for fn in ("nvmlDeviceGetSamples", "nvmlDeviceGetProcessUtilization",
                                                    "nvmlDeviceGetComputeRunningProcesses_v3",
                                                    "nvmlDeviceGetUtilizationRates")}
        while not self._stop.is_set():
            if ok["nvmlDeviceGetComputeRunningProcesses_v3"]:
                self._poll_mem()
            if k % 2 == 0:
                if ok["nvmlDeviceGetSamples"]:
                    last = self._poll_samples(last)
                if ok["nvmlDeviceGetProcessUtilization"]:
                    self._poll_proc(seen)
                if ok["nvmlDeviceGetUtilizationRates"]:
                    self._poll_rates()
            if k % 20 == 0 and self._offsets:
                off = statistics.median(self._offsets[-50:])
                # NVML stamps samples with the CPU's wall clock in µs; if not, shift by the lag
                self.clock_offset_s = off if abs(off) > 2 else 0.0
            k += 1
            self._stop.wait(0.05)

    def window(self, a: float, b: float) -> dict[str, Any]:
        """Everything sampled in [a-1, b+1] (wall clock), NVML times shifted to it."""
        off = self.clock_offset_s
        with self._lock:
            dev = [(t + off, v) for t, v in self.dev if a - 1 <= t + off <= b + 1]
            proc = [(p, t + off, v) for p, t, v in self.proc if a - 1 <= t + off <= b + 1]
            mem = [m for m in self.mem if a - 1 <= m[0] <= b + 1]
            rates = [r for r in self.rates if a - 1 <= r[0] <= b + 1]
        return {"dev": dev, "proc": proc, "mem": mem, "rates": rates}


class FakeSampler(NvmlSampler):
    """For --selftest: samples made up from what the fake workloads say they did."""

    def __init__(self) -> None:
        super().__init__()
        self.uuid, self.name = "GPU-00000000-fake-0000-0000-000000000000", "Fake H200"
        self.busy: dict[int, float] = {}  # pid -> busy % while alive
        self.alive: dict[int, tuple[float, float, float]] = {}  # pid -> (t0, t1, MiB)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        rnd = random.Random(1)
        while not self._stop.is_set():
            now = time.time()
            with self._lock:
                live = {p: v for p, v in self.busy.items() if self.alive.get(p, (0, 0, 0))[0] <= now
                        <= self.alive.get(p, (0, 0, 0))[1]}
                tot = min(100.0, sum(live.values()))
                self.dev.append((now, max(0.0, tot + rnd.uniform(-2, 2)) if live else 0.0))
                self.rates.append((now, tot))
                for p, v in live.items():
                    self.proc.append((p, now, v))
                for p, (a, b, m) in self.alive.items():
                    if a <= now <= b:
                        self.mem.append((now, p, m))
            self._stop.wait(0.05)


# ------------------------------------------------------------------------------------ running


def base_env() -> dict[str, str]:
    drop = ("LD_PRELOAD", "CUDA_REDIRECT", "GPU_CORE_UTILIZATION_POLICY", "CUDA_TASK_PRIORITY",
            "ACTIVE_OOM_KILLER")
    env = {k: v for k, v in os.environ.items()
           if k not in drop and not k.startswith(("KVGPU_", "CUDA_DEVICE_"))}
    env["PYTHONUNBUFFERED"] = "1"
    env["NCCL_NVLS_ENABLE"] = "0"
    return env


@dataclass
class Tenancy:
    """One container: its claim, and the processes that run in it."""

    cid: str  # claim name suffix: bench/<cid>
    mem_mib: int
    cores: int
    prio: int = 1
    cdir: str = ""  # its region directory (kvgpu) / cache folder (HAMi)


def mode_env(cfg: Config, mode: str, t: Tenancy) -> dict[str, str]:
    if mode == "native":
        return {}
    if mode == "kvgpu":
        return {"LD_PRELOAD": cfg.kvgpu_lib, "KVGPU_REGION_DIR": t.cdir, "KVGPU_SCHED_DIR": cfg.sched_dir,
                "KVGPU_CLAIM": f"v1;claim=bench/{t.cid};priority={t.prio};dev={cfg.uuid},{t.mem_mib},{t.cores}"}
    if mode == "mps":  # the kvgpu shim with a mode=mps claim: an MPS client of the card's daemon
        return {"LD_PRELOAD": cfg.kvgpu_lib, "KVGPU_REGION_DIR": t.cdir,
                "CUDA_MPS_PIPE_DIRECTORY": os.path.join(cfg.mps_dir, "pipe"),
                "KVGPU_CLAIM": f"v1;claim=bench/{t.cid};priority={t.prio};dev={cfg.uuid},{t.mem_mib},{t.cores}"
                               ";mode=mps"}
    if mode == "hami":
        e = {"LD_PRELOAD": cfg.hami_lib, "CUDA_REDIRECT": cfg.hami_lib,
             "CUDA_DEVICE_MEMORY_LIMIT": f"{t.mem_mib}m",
             "CUDA_DEVICE_MEMORY_SHARED_CACHE": os.path.join(t.cdir, "hami.cache"),
             "CUDA_TASK_PRIORITY": str(t.prio)}
        if t.cores:
            e["CUDA_DEVICE_SM_LIMIT"] = str(t.cores)
            e["GPU_CORE_UTILIZATION_POLICY"] = "force"
        return e
    raise ValueError(mode)


def slug(s: str) -> str:
    return "".join(c if c.isalnum() or c == "-" else "-" for c in s.lower()).strip("-")


class AgentSchedule:
    """The node agent's own Scheduler (kvgpu.agent.schedule) for the tenants of the current run:
    it reads their regions (activity, join time, measured busy share) and rewrites the card's
    schedule file every 250 ms, as the agent does on a node."""

    def __init__(self, sched_dir: str, uuid: str) -> None:
        from kvgpu.agent.schedule import Scheduler, TenantSource

        self._ts = TenantSource
        self.uuid = uuid
        self.current: list[Any] = []
        self.sch = Scheduler(sched_dir=Path(sched_dir), sources=lambda: list(self.current), cards=lambda: [uuid])
        self._seen: list[list[dict[str, Any]]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.errors: list[str] = []
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def set(self, tenants: Sequence[Tenancy]) -> None:
        with self._lock:
            self.current = [self._ts(f"bench/{t.cid}", t.prio, {self.uuid: t.cores}, Path(t.cdir) / "vgpu.region")
                            for t in tenants]
            self._seen = []

    def seen(self) -> list[list[dict[str, Any]]]:
        with self._lock:
            return list(self._seen)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                lay = self.sch.tick().get(self.uuid, [])
                cur = [{"key": w.key, "offset_pm": w.offset_pm, "len_pm": w.len_pm} for w in lay]
                with self._lock:
                    if self.current and (not self._seen or self._seen[-1] != cur):
                        self._seen.append(cur)
            except Exception as e:  # keep scheduling; report it
                if len(self.errors) < 5:
                    self.errors.append(repr(e))
            self._stop.wait(0.25)

    def stop(self) -> None:
        self._stop.set()
        self._t.join(2)


def agent_available() -> str:
    """'' if the agent's Scheduler can read regions here (the shim's cffi core imports), else why."""
    try:
        if str(TREE / "shim/_build") not in sys.path:
            sys.path.insert(0, str(TREE / "shim/_build"))
        import importlib

        importlib.import_module("_vgpucore")
        return ""
    except Exception as e:
        return f"no cffi shim core ({e!r})"


class Runner:
    def __init__(self, cfg: Config, sampler: NvmlSampler) -> None:
        self.cfg = cfg
        self.s = sampler
        self.agent: AgentSchedule | None = None
        self.logs = cfg.out / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.tmp = Path(tempfile.mkdtemp(prefix="kvgpu-suite-"))
        self.cache = self.tmp / "inductor"
        self.cache.mkdir()

    # -- commands
    def wl_cmd(self, kind: str, secs: float, calib: Any, ready: str = "", go: str = "") -> list[str]:
        if self.cfg.fake:
            cmd = [self.cfg.py, str(Path(__file__).resolve()), "--fake-wl", kind, str(secs)]
        elif kind.startswith("spin"):
            return [self.cfg.suite_cu, "spin", str(int(calib or 0)), str(secs), kind[4:]]
        else:
            cmd = [self.cfg.py, str(HERE / "suite_wl.py"), kind, str(secs)]
        if calib is not None:
            cmd += ["--calib", str(calib)]
        if ready:
            cmd += ["--ready", ready, "--go", go]
        return cmd

    def cu_cmd(self, *args: str) -> list[str]:
        if self.cfg.fake:
            return [self.cfg.py, str(Path(__file__).resolve()), "--fake-cu", *args]
        return [self.cfg.suite_cu, *args]

    def container(self, cid: str, mem: int, cores: int, prio: int = 1) -> Tenancy:
        d = Path(tempfile.mkdtemp(prefix=f"c-{cid}-", dir=self.tmp))
        return Tenancy(cid=slug(cid), mem_mib=mem, cores=cores, prio=prio, cdir=str(d))

    def spawn(self, tag: str, cmd: list[str], mode: str, t: Tenancy) -> tuple[subprocess.Popen[bytes], Path]:
        env = base_env()
        env.update({"TORCHINDUCTOR_CACHE_DIR": str(self.cache / "inductor"),
                    "TRITON_CACHE_DIR": str(self.cache / "triton"), "TORCHINDUCTOR_COMPILE_THREADS": "1"})
        env.update(mode_env(self.cfg, mode, t))
        out = self.logs / f"{tag}.out"
        with open(out, "wb") as fo, open(self.logs / f"{tag}.err", "wb") as fe:
            p = subprocess.Popen(cmd, env=env, stdout=fo, stderr=fe, cwd=ROOT, start_new_session=True)
        if isinstance(self.s, FakeSampler):
            self.s.alive[p.pid] = (time.time(), time.time() + 3600, 0.0)
        return p, out

    def finish(self, tag: str, p: subprocess.Popen[bytes], out: Path, timeout: float) -> dict[str, Any]:
        """Wait for a process; its last JSON line with a "kind", or an error."""
        res: dict[str, Any] = {}
        try:
            rc = p.wait(timeout=max(1.0, timeout))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, 9)
            p.wait()
            rc = None
        end = time.time()
        if isinstance(self.s, FakeSampler) and p.pid in self.s.alive:
            a, _, m = self.s.alive[p.pid]
            self.s.alive[p.pid] = (a, end, m)
        for line in out.read_text(errors="replace").splitlines():
            if line.startswith("{"):
                with contextlib.suppress(ValueError):
                    d = json.loads(line)
                    if "kind" in d or "error" in d:
                        res = d
        res["_pid"], res["_rc"], res["_end"] = p.pid, rc, end
        if rc is None:
            res["error"] = f"timeout after {timeout:.0f} s (killed)"
        elif rc != 0 or "kind" not in res:
            tail = (self.logs / f"{tag}.err").read_text(errors="replace")[-800:]
            res.setdefault("error", f"rc {rc}: {tail.strip()[-400:]}")
        return res

    def sched(self, mode: str, tenants: Sequence[Tenancy]) -> list[dict[str, Any]]:
        """kvgpu: the node agent's schedule for these tenants. With the agent's Scheduler (it reads
        the tenants' regions, so it needs the shim's cffi core) it runs every 250 ms through the
        run, as on a node; without it, the agent's layout of the limited tenants, written once."""
        if mode != "kvgpu":
            if self.agent:
                self.agent.set([])
            return []
        if self.agent:
            self.agent.set(tenants)
            return []
        ts = [Tenant(f"bench/{t.cid}", t.prio, t.cores * 10, i) for i, t in enumerate(tenants) if limited(t.cores)]
        wins = layout(ts)
        write_schedule(self.cfg.sched_dir, self.cfg.uuid, encode(wins))
        return [{"key": w.key, "offset_pm": w.offset_pm, "len_pm": w.len_pm} for w in wins]

    def sched_seen(self, static: list[dict[str, Any]]) -> list[Any]:
        """The layouts the schedule held during the run (each distinct one once)."""
        return self.agent.seen() if self.agent else [static]

    # -- one workload alone
    def single(self, ident: str, kind: str, mode: str, limit: int | None, calib: Any) -> dict[str, Any]:
        secs = self.cfg.secs * (1.5 if kind in ("infer", "spin1", "spin10") else 1.0)
        name = slug(f"{ident}-{limit or 'none'}-{mode}")
        tag = name
        t = self.container(name, COMPUTE_MEM_MIB, limit or 0)
        sched = self.sched(mode, [t])
        p, out = self.spawn(tag, self.wl_cmd(kind, secs, calib), mode, t)
        if isinstance(self.s, FakeSampler):
            self.s.busy[p.pid] = fake_busy(kind, mode, limit)
        warm = 240 if kind == "compile" else 90
        res = self.finish(tag, p, out, secs + warm)
        rec: dict[str, Any] = {"id": ident, "section": "single", "kind": kind, "mode": mode, "limit": limit,
                               "secs": secs, "schedule": self.sched_seen(sched) if mode == "kvgpu" else [],
                               "result": res}
        if "t0" in res and "t1" in res:
            rec["samples"] = self.s.window(res["t0"], res["t1"])
        return rec

    # -- co-tenants
    def group(self, ident: str, tenants: list[tuple[int, int]], mode: str) -> dict[str, Any]:
        secs = self.cfg.secs
        ts = [self.container(f"{ident}-{mode}-{i}", COMPUTE_MEM_MIB, c if mode != "native" else 0, pr)
              for i, (pr, c) in enumerate(tenants)]
        sched = self.sched(mode, ts)
        go = self.tmp / f"go-{slug(ident)}-{mode}"
        procs = []
        for i, t in enumerate(ts):
            ready = self.tmp / f"ready-{slug(ident)}-{mode}-{i}"
            tag = slug(f"{ident}-{mode}-t{i}")
            p, out = self.spawn(tag, self.wl_cmd("mm", secs, None, str(ready), str(go)), mode, t)
            if isinstance(self.s, FakeSampler):
                self.s.busy[p.pid] = fake_group_busy(tenants, i, mode)
            procs.append((tag, p, out, ready))
        deadline = time.time() + 120
        while time.time() < deadline and not all(r.exists() for *_, r in procs):
            if any(p.poll() is not None for _, p, _, _ in procs):
                break
            time.sleep(0.01)
        go.touch()
        results = [self.finish(tag, p, out, secs + 30) for tag, p, out, _ in procs]
        rec: dict[str, Any] = {"id": ident, "section": "group", "mode": mode, "tenants": [
            {"prio": pr, "cores": c, "result": r} for (pr, c), r in zip(tenants, results, strict=True)],
            "schedule": self.sched_seen(sched) if mode == "kvgpu" else [], "secs": secs}
        t0s = [r["t0"] for r in results if "t0" in r]
        t1s = [r["t1"] for r in results if "t1" in r]
        if t0s and t1s:
            rec["window"] = [max(t0s), min(t1s)]
            rec["samples"] = self.s.window(min(t0s), max(t1s))
        return rec

    # -- memory cases
    def memory(self, case: str, mode: str) -> dict[str, Any]:
        limit = GRAPH_LIMIT if case == "graphmem" else HEAP_LIMIT
        maxn = "8" if mode == "native" else "40"
        t = self.container(f"{case}-{mode}", limit, 0)
        if case == "graphmem":
            args = ["graphmem", str(2 << 30), str(256 * MIB), maxn, "1.0"]
        else:
            args = ["heap", str(1 << 30), str(128 << 10), "3", str(256 * MIB), maxn, "1.0"]
        tag = slug(f"{case}-{mode}")
        start = time.time()
        p, out = self.spawn(tag, self.cu_cmd(*args), mode, t)
        if isinstance(self.s, FakeSampler):
            self.s.alive[p.pid] = (start, start + 3600, fake_mem(case, mode, limit))
        res = self.finish(tag, p, out, 60)
        w = self.s.window(start, res["_end"])
        peak = max((m for _, pid, m in w["mem"] if pid == res["_pid"]), default=None)
        return {"id": case, "section": "memory", "mode": mode, "limit_mib": limit if mode != "native" else None,
                "case_limit_mib": limit, "result": res, "nvml_peak_mib": peak,
                "nvml_samples": sum(1 for _, pid, _ in w["mem"] if pid == res["_pid"])}

    # -- start-up under contention
    def startup(self, mode: str) -> dict[str, Any]:
        t = self.container(f"startup-{mode}", START_LIMIT, 0)
        go = self.tmp / f"go-startup-{mode}"
        cap = START_LIMIT * MIB // START_RACERS
        racer_secs = 1.5 + 1.2 * START_ROUNDS
        racers = []
        for i in range(START_RACERS):
            tag = f"startup-{mode}-racer{i}"
            p, out = self.spawn(tag, self.cu_cmd("racer", str(64 * MIB), str(cap), str(racer_secs), str(go)), mode, t)
            racers.append((tag, p, out))
        deadline = time.time() + 60
        while time.time() < deadline:
            if all("ready" in out.read_text(errors="replace") for _, _, out in racers):
                break
            if any(p.poll() is not None for _, p, _ in racers):
                break
            time.sleep(0.02)
        go.touch()
        time.sleep(0.5)
        rounds = []
        for r in range(START_ROUNDS):
            tag = f"startup-{mode}-new{r}"
            p, out = self.spawn(tag, self.cu_cmd("newcomer", f"{time.time():.6f}", str(2 * MIB)), mode, t)
            rounds.append(self.finish(tag, p, out, 30))
            time.sleep(0.2)
        rres = [self.finish(tag, p, out, racer_secs + 30) for tag, p, out in racers]
        return {"id": "startup", "section": "startup", "mode": mode, "limit_mib": START_LIMIT,
                "racers": rres, "rounds": rounds}


# ------------------------------------------------------------------------------------ fakes


def fake_busy(kind: str, mode: str, limit: int | None) -> float:
    nat = {"gpt": 80, "conv": 90, "infer": 12, "graphs": 99, "compile": 97, "mm": 99}.get(kind, 99)
    if mode == "native" or not limit:
        return nat
    if mode == "hami":
        return nat * 0.97
    return min(nat, limit * 0.95)


def fake_group_busy(tenants: list[tuple[int, int]], i: int, mode: str) -> float:
    if mode == "native":
        return 100 / len(tenants)
    c = tenants[i][1] or 100
    return c * 100 / max(100, sum(x or 100 for _, x in tenants))


def fake_mem(case: str, mode: str, limit: int) -> float:
    return {"native": 3100.0, "hami": limit * 1.4, "kvgpu": limit * 0.95, "mps": limit * 0.95}[mode]


def fake_wl(kind: str, secs: float, calib: str | None, ready: str | None, go: str | None) -> None:
    """Stands in for suite_wl.py / suite_cu spin in --selftest: sleeps through a short window."""
    time.sleep(0.05)
    if ready:
        Path(ready).touch()
        while go and not os.path.exists(go):
            time.sleep(0.005)
    t0 = time.time()
    time.sleep(secs)
    rate = {"gpt": 60, "conv": 40, "infer": 20, "graphs": 50, "compile": 80, "mm": 370, "spin1": 10,
            "spin10": 10}[kind]
    n = int(rate * secs)
    res: dict[str, Any] = {"kind": kind, "unit": "units", "t0": t0, "t1": t0 + secs, "n": n, "its": n / secs,
                           "marks": [[round((i + 1) / rate, 4), i + 1] for i in range(n)], "pid": os.getpid()}
    if kind == "infer":
        lat = [6 + random.random() * 3 for _ in range(n)]
        res.update({"lat_ms": lat, "p50_ms": sorted(lat)[len(lat) // 2], "p99_ms": max(lat), "calib": 30})
    if kind.startswith("spin"):
        res = {"kind": "spin", "unit": "kernels", "iters": 123, "t0": t0, "t1": t0 + secs, "launched": n,
               "completed": n, "done_ms": [100.0 * (i + 1) for i in range(n)]}
    print(json.dumps(res))


def fake_cu(args: list[str]) -> None:
    if args[0] == "racer":
        print(json.dumps({"ready": time.time()}), flush=True)
        while not os.path.exists(args[4]):
            time.sleep(0.005)
        time.sleep(float(args[3]))
        print(json.dumps({"kind": "racer", "cycles": 10, "allocs": 100, "refused": 5}))
    elif args[0] == "newcomer":
        print(json.dumps({"kind": "newcomer", "spawn_to_main_s": time.time() - float(args[1]), "init_s": 0.2,
                          "ctx_s": 0.1, "init_ctx_s": 0.3, "first_alloc_s": 0.001, "to_first_answer_s": 0.35,
                          "alloc_rc": 0}))
    else:
        time.sleep(1.2)
        print(json.dumps({"kind": args[0], "chunks": 3, "chunk_mib": 256, "last_rc": 2, "launch_rc": 0}))


# ------------------------------------------------------------------------------------ analysis


def busy_share(samples: Sequence[Sequence[float]], a: float, b: float, period: float
               ) -> tuple[float | None, list[float]]:
    """Time-weighted mean of a busy-% step function over [a, b], and per whole second from a.
    Each sample (t, v) covers (max(previous t, t - period), t]."""
    pts = sorted((float(s[0]), float(s[1])) for s in samples)
    if b <= a or not pts:
        return None, []
    secs = max(1, int(b - a + 1e-6))
    edges = [(a + i, min(b, a + i + 1)) for i in range(secs)] + [(a, b)]
    acc = [0.0] * len(edges)
    cov = [0.0] * len(edges)
    prev = None
    for t, v in pts:
        lo = t - period if prev is None else max(prev, t - period)
        prev = t
        for k, (x, y) in enumerate(edges):
            o = min(t, y) - max(lo, x)
            if o > 0:
                acc[k] += v * o
                cov[k] += o
    vals = [acc[k] / (y - x) if cov[k] > 0.5 * (y - x) else math.nan for k, (x, y) in enumerate(edges)]
    mean = vals[-1]
    return (None if math.isnan(mean) else mean), list(vals[:-1])


def sample_period(dev: Sequence[Sequence[float]]) -> float:
    ts = sorted(float(s[0]) for s in dev)
    d = [y - x for x, y in itertools.pairwise(ts) if y > x]
    return statistics.median(d) if d else 0.1667


def proc_share(proc: Sequence[Sequence[float]], pid: int, a: float, b: float, period: float
               ) -> tuple[float | None, list[float]]:
    """One process's share from nvmlDeviceGetProcessUtilization samples: on a grid of the sample
    period, the process's latest sample in each step, 0 where it has none (NVML reports only
    processes that used the GPU in the last period)."""
    if not proc:
        return None, []
    mine = sorted((float(p[1]), float(p[2])) for p in proc if int(p[0]) == pid)
    grid: list[tuple[float, float]] = []
    t, j = a - period, 0
    while t <= b + period:
        v = 0.0
        while j < len(mine) and mine[j][0] <= t:
            if mine[j][0] > t - period:
                v = mine[j][1]
            j += 1
        grid.append((t, v))
        t += period
    return busy_share(grid, a, b, period)


def units_at(marks: Sequence[Sequence[float]], t: float) -> float:
    """Units done at t seconds after the workload's t0 (linear between its sync marks)."""
    px, py = 0.0, 0.0
    for x, y in marks:
        if x >= t:
            return py + (y - py) * ((t - px) / (x - px) if x > px else 1.0)
        px, py = x, y
    return py


def marks_of(res: dict[str, Any]) -> list[list[float]]:
    if res.get("kind") == "spin":
        return [[ms / 1e3, i + 1] for i, ms in enumerate(res.get("done_ms", []))]
    return res.get("marks", [])


def rate(res: dict[str, Any], a: float, b: float) -> float | None:
    """Units per second in the wall-clock window [a, b]."""
    if "t0" not in res or b <= a:
        return None
    m = marks_of(res)
    return (units_at(m, b - res["t0"]) - units_at(m, a - res["t0"])) / (b - a)


def per_second_rates(res: dict[str, Any], a: float, b: float) -> list[float]:
    return [r for i in range(max(0, int(b - a + 1e-6))) if (r := rate(res, a + i, a + i + 1)) is not None]


def stats(vals: Iterable[float]) -> dict[str, float | None]:
    v = [x for x in vals if x is not None and not math.isnan(x)]
    if not v:
        return {"min": None, "max": None, "sd": None}
    return {"min": min(v), "max": max(v), "sd": statistics.pstdev(v) if len(v) > 1 else 0.0}


def rnd(x: Any, n: int = 2) -> Any:
    if isinstance(x, float):
        return None if math.isnan(x) else round(x, n)
    if isinstance(x, dict):
        return {k: rnd(v, n) for k, v in x.items()}
    if isinstance(x, list):
        return [rnd(v, n) for v in x]
    return x


def window_of(rec: dict[str, Any]) -> tuple[float, float] | None:
    res = rec.get("result", {})
    if "t0" not in res or "t1" not in res:
        return None
    if res.get("kind") == "spin":
        return res["t0"], res["t0"] + rec.get("secs", res["t1"] - res["t0"])
    return res["t0"], res["t1"]


def analyze_single(rec: dict[str, Any], native: dict[str, Any] | None) -> dict[str, Any]:
    res = rec.get("result", {})
    w = window_of(rec)
    m: dict[str, Any] = {}
    if w is None:
        return {"failed": res.get("error", "no result")}
    a, b = w
    s = rec.get("samples") or {"dev": [], "proc": [], "rates": []}
    per = sample_period(s["dev"])
    busy, busy_sec = busy_share(s["dev"], a, b, per)
    rates_busy, _ = busy_share(s.get("rates", []), a, b, 0.1)
    its = rate(res, a, b)
    m.update({"its": its, "unit": res.get("unit"), "busy": busy, "busy_rates": rates_busy,
              "busy_sec": busy_sec, "busy_sec_stats": stats(busy_sec), "sample_period_s": per,
              "n_samples": len(s["dev"])})
    pid = res.get("pid", res.get("_pid"))
    if pid is not None and s.get("proc"):
        m["proc_busy"], _ = proc_share(s["proc"], int(pid), a, b, per)
    if "p50_ms" in res:
        m.update({k: res[k] for k in ("p50_ms", "p99_ms", "max_ms", "mean_ms") if k in res})
    if res.get("kind") == "spin":
        m["kernel_ms"] = res.get("calib_ms")
        m["completed"] = sum(1 for ms in res.get("done_ms", []) if ms / 1e3 <= b - a)
    if "error" in res:
        m["error"] = res["error"]
    if native is None or rec["mode"] == "native":
        return m
    nm = native.get("metrics", {})
    lim = rec.get("limit")
    if nm.get("its") and its is not None:
        m["share"] = 100 * its / nm["its"]
        sec = per_second_rates(res, a, b)
        m["share_sec"] = [100 * r / nm["its"] for r in sec]
        m["share_sec_stats"] = stats(m["share_sec"])
    nb = nm.get("busy")
    if lim and nb is not None:
        tb = min(float(lim), nb)
        m["target_busy"] = tb
        m["target_share"] = min(100.0, 100 * lim / nb) if nb > 0 else None
        if busy is not None:
            m["err_pts"] = busy - tb
            full = [v for v in busy_sec if not math.isnan(v)]
            m["sec_max_dev"] = max((abs(v - tb) for v in full), default=None)
            m["met_busy"] = abs(busy - tb) <= 3
            m["met_even"] = m["sec_max_dev"] is not None and m["sec_max_dev"] <= 3
        if "share" in m and m["target_share"] is not None:
            m["share_err_pts"] = m["share"] - m["target_share"]
    if "p99_ms" in m and nm.get("p99_ms"):
        m["p99_vs_native"] = m["p99_ms"] / nm["p99_ms"]
        m["met_latency"] = m["p99_ms"] <= 1.2 * nm["p99_ms"]
    return m


def expected_split(tenants: Sequence[tuple[int, int]]) -> list[float]:
    """The documented split (docs/shim.md, "Schedule file"): the agent's layout for the limited
    tenants; an unlimited priority-0 tenant takes what the limited priority-0 ones leave and
    priority-1 tenants get nothing then (low priority gets what high priority leaves)."""
    lim = [Tenant(f"t{i}", p, c * 10, i) for i, (p, c) in enumerate(tenants) if limited(c)]
    wins = {w.key: w.len_pm / 10 for w in layout(lim)}
    hi_free = [i for i, (p, c) in enumerate(tenants) if p == 0 and not limited(c)]
    out = []
    for i, (p, c) in enumerate(tenants):
        if hi_free:
            taken = sum(wins.get(f"t{j}", 0.0) for j, (pj, _) in enumerate(tenants) if pj == 0)
            out.append((100 - taken) / len(hi_free) if i in hi_free else (wins.get(f"t{i}", 0.0) if p == 0 else 0.0))
        elif not limited(c):
            out.append(100.0 - sum(wins.values()))
        else:
            out.append(wins.get(f"t{i}", 0.0))
    return out


def analyze_group(rec: dict[str, Any], native_mm: dict[str, Any] | None) -> dict[str, Any]:
    if "window" not in rec:
        errs = [t["result"].get("error") for t in rec["tenants"] if t["result"].get("error")]
        return {"failed": "; ".join(e for e in errs if e) or "no result"}
    a, b = rec["window"]
    s = rec.get("samples") or {"dev": [], "proc": []}
    per = sample_period(s["dev"])
    exp = expected_split([(t["prio"], t["cores"]) for t in rec["tenants"]])
    base = (native_mm or {}).get("metrics", {}).get("its")
    out = []
    for t, e in zip(rec["tenants"], exp, strict=True):
        r = t["result"]
        its = rate(r, a, b)
        pb, pbs = proc_share(s["proc"], int(r.get("pid", r.get("_pid", -1))), a, b, per) if s["proc"] else (None, [])
        d: dict[str, Any] = {"its": its, "proc_busy": pb, "proc_busy_sec_stats": stats(pbs),
                             "expected": e if rec["mode"] != "native" else None}
        if base and its is not None:
            d["share"] = 100 * its / base
            d["share_sec_stats"] = stats(100 * x / base for x in per_second_rates(r, a, b))
            if rec["mode"] != "native":
                d["err_pts"] = d["share"] - e
                d["met"] = abs(d["err_pts"]) <= 3
        if "error" in r:
            d["error"] = r["error"]
        out.append(d)
    busy, _ = busy_share(s["dev"], a, b, per)
    return {"tenants": out, "busy": busy, "window_s": b - a,
            "sum_share": sum(d.get("share", 0) for d in out) if base else None}


def analyze_memory(rec: dict[str, Any]) -> dict[str, Any]:
    r = rec["result"]
    lim = rec.get("limit_mib")
    m: dict[str, Any] = {"nvml_peak_mib": rec.get("nvml_peak_mib"), "chunks": r.get("chunks"),
                         "granted_mib": (r.get("chunks") or 0) * (r.get("chunk_mib") or 0)}
    for k in ("launch_rc", "instantiate_rc", "node_rc", "limit_rc", "kernel_rc", "contexts", "ctx_rc",
              "mallocs_ok", "last_rc", "meminfo"):
        if k in r:
            m[k] = r[k]
    if lim and m["nvml_peak_mib"] is not None:
        m["over_limit_mib"] = m["nvml_peak_mib"] - lim
        m["met"] = m["nvml_peak_mib"] <= lim
    if "error" in r:
        m["error"] = r["error"]
    return m


def analyze_startup(rec: dict[str, Any], native: dict[str, Any] | None) -> dict[str, Any]:
    ok = [r for r in rec["rounds"] if "init_ctx_s" in r]
    m: dict[str, Any] = {"rounds": len(ok)}
    if not ok:
        return {"failed": "; ".join(str(r.get("error")) for r in rec["rounds"])}
    for k in ("spawn_to_main_s", "init_s", "ctx_s", "init_ctx_s", "first_alloc_s", "to_first_answer_s"):
        m[k] = statistics.median(r[k] for r in ok)
    m["alloc_rcs"] = [r.get("alloc_rc") for r in ok]
    m["racers"] = [{k: r.get(k) for k in ("cycles", "allocs", "refused", "error") if k in r} for r in rec["racers"]]
    nm = (native or {}).get("metrics", {})
    if rec["mode"] != "native" and nm.get("to_first_answer_s") is not None:
        goal = 1.2 * nm["to_first_answer_s"] + 0.05
        m["goal_s"] = goal
        m["met"] = m["to_first_answer_s"] <= goal
        m["init_goal_s"] = 1.2 * nm["init_ctx_s"] + 0.05
    return m


def analyze(runs: list[dict[str, Any]], baseline: dict[str, Any]) -> None:
    """Fill rec["metrics"] of every run (native records from this run, else from the baseline)."""
    nat: dict[tuple[str, str], dict[str, Any]] = {}
    natc: dict[tuple[str, str, int], dict[str, Any]] = {}
    for src in (baseline.get("runs", []), runs):
        for r in src:
            if r.get("mode") == "native" and not r.get("skipped"):
                nat[(r["section"], r["id"])] = r
                natc[(r["section"], r["id"], r.get("call", 0))] = r

    def native(section: str, ident: str, r: dict[str, Any]) -> dict[str, Any] | None:
        """The native run of the same call (merged documents), else any."""
        return natc.get((section, ident, r.get("call", 0))) or nat.get((section, ident))

    for r in runs:
        if r.get("skipped"):
            continue
        if r["section"] == "single":
            n = native("single", r["id"].split("@")[0], r)
            if r["mode"] == "native":
                r["metrics"] = analyze_single(r, None)
            else:
                if n is not None and "metrics" not in n:
                    n["metrics"] = analyze_single(n, None)
                r["metrics"] = analyze_single(r, n)
        elif r["section"] == "group":
            n = native("single", "mm", r)
            if n is not None and "metrics" not in n:
                n["metrics"] = analyze_single(n, None)
            r["metrics"] = analyze_group(r, n)
        elif r["section"] == "memory":
            r["metrics"] = analyze_memory(r)
        elif r["section"] == "startup":
            n = native("startup", "startup", r)
            if n is not None and "metrics" not in n:
                n["metrics"] = analyze_startup(n, None)
            r["metrics"] = analyze_startup(r, n if r["mode"] != "native" else None)


# ------------------------------------------------------------------------------------ reports


def f(x: Any, n: int = 1, suffix: str = "") -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "–"
    if isinstance(x, bool):
        return "yes" if x else "**no**"
    if isinstance(x, (int, float)):
        return f"{x:.{n}f}{suffix}"
    return str(x)


def pick(runs: list[dict[str, Any]], section: str, ident: str, mode: str) -> dict[str, Any] | None:
    for r in runs:
        if r.get("section") == section and r.get("id") == ident and r.get("mode") == mode:
            return r
    return None


def err_text(r: dict[str, Any] | None) -> str:
    if r is None:
        return "not run"
    if r.get("skipped"):
        return f"skipped ({r['skipped']})"
    m = r.get("metrics", {})
    e = m.get("failed") or m.get("error")
    return "failed: " + str(e).replace("|", "/").replace("\n", " ")[:160] if e else ""


def markdown(doc: dict[str, Any]) -> str:
    runs = doc["runs"]
    L: list[str] = []
    env = doc.get("env", {})
    L.append(f"# kvgpu workload suite — {env.get('date', '')}\n")
    L.append(f"card: {env.get('card', '')} `{env.get('uuid', '')}`; secs per workload: {env.get('secs')}; "
             f"modes: {' '.join(env.get('modes', []))}; NVML sample period "
             f"{f(env.get('sample_period_s'), 3)} s; sampler errors: {env.get('sampler_errors') or 'none'}\n")
    L.append("## Compute, one tenant\n")
    L.append("busy = the card's busy share (NVML GPU-utilization samples, time-weighted over the measured "
             "window); share = throughput as % of native; target = min(limit, native busy); err = busy − "
             "target in points; per-second = busy share of each whole second (min/max/sd).\n")
    L.append("| workload | limit | native its (busy %) | mode | share % | busy % | target | err pts | "
             "per-second busy min/max/sd | goal met (mean / every s) | note |")
    L.append("|---|---|---|---|---|---|---|---|---|---|---|")
    for ident, _kind, limits in SINGLES:
        nat = pick(runs, "single", ident, "native")
        nm = (nat or {}).get("metrics", {})
        ntxt = f"{f(nm.get('its'), 2)} {nm.get('unit') or ''}/s ({f(nm.get('busy'))} %)" if nat else "–"
        if not limits:
            L.append(f"| {ident} | – | {ntxt} | native | 100 | {f(nm.get('busy'))} | | | "
                     f"{fmt_stats(nm.get('busy_sec_stats'))} | | {err_text(nat)} |")
        for lim in limits:
            for mode in doc["env"].get("modes", []):
                if mode == "native":
                    continue
                r = pick(runs, "single", f"{ident}@{lim}", mode)
                m = (r or {}).get("metrics", {})
                met = f"{f(m.get('met_busy'))} / {f(m.get('met_even'))}" if "met_busy" in m else ""
                L.append(f"| {ident} | {lim} % | {ntxt} | {mode} | {f(m.get('share'))} | {f(m.get('busy'))} | "
                         f"{f(m.get('target_busy'))} | {f(m.get('err_pts'), 1)} | "
                         f"{fmt_stats(m.get('busy_sec_stats'))} | {met} | {err_text(r)} |")
    L.append("\n## Latency-sensitive inference (a ~6 ms request every 50 ms)\n")
    L.append("| mode | limit | p50 ms | p99 ms | max ms | p99 ÷ native | goal p99 ≤ 1.2 × native |")
    L.append("|---|---|---|---|---|---|---|")
    for mode in doc["env"].get("modes", []):
        r = pick(runs, "single", "infer" if mode == "native" else "infer@30", mode)
        m = (r or {}).get("metrics", {})
        L.append(f"| {mode} | {'–' if mode == 'native' else '30 %'} | {f(m.get('p50_ms'), 2)} | "
                 f"{f(m.get('p99_ms'), 2)} | {f(m.get('max_ms'), 2)} | {f(m.get('p99_vs_native'), 2)} | "
                 f"{f(m.get('met_latency')) if 'met_latency' in m else ''} {err_text(r)} |")
    L.append("\n## Co-tenants (each tenant the fp32 matmul loop; share = % of the native single tenant)\n")
    L.append("| group | mode | tenant (prio, limit) | share % | expected % | err pts | per-process busy % | "
             "per-second share min/max | met | note |")
    L.append("|---|---|---|---|---|---|---|---|---|---|")
    for gid, tenants in [*GROUPS, ("pair-native", [(1, 0), (1, 0)])]:
        for mode in doc["env"].get("modes", []):
            if (gid == "pair-native") != (mode == "native"):
                continue
            r = pick(runs, "group", gid, mode)
            ts = (r or {}).get("metrics", {}).get("tenants") or [{}] * len(tenants)
            for i, ((pr, c), m) in enumerate(zip(tenants, ts, strict=False)):
                st = m.get("share_sec_stats") or {}
                L.append(f"| {gid} | {mode} | {chr(65 + i)} ({pr}, {c or 'none'}) | {f(m.get('share'))} | "
                         f"{f(m.get('expected'))} | {f(m.get('err_pts'))} | {f(m.get('proc_busy'))} | "
                         f"{f(st.get('min'))}/{f(st.get('max'))} | {f(m.get('met')) if 'met' in m else ''} | "
                         f"{err_text(r) if i == 0 else ''} |")
    L.append("\n## Memory limit on paths the hooks do not see (NVML per-process peak, read outside)\n")
    L.append("| case | mode | limit MiB | NVML peak MiB | over limit MiB | chunks of 256 MiB granted | "
             "details | peak ≤ limit |")
    L.append("|---|---|---|---|---|---|---|---|")
    for case in ("graphmem", "heap"):
        for mode in doc["env"].get("modes", []):
            r = pick(runs, "memory", case, mode)
            m = (r or {}).get("metrics", {})
            det = ", ".join(f"{k} {m[k]}" for k in ("launch_rc", "limit_rc", "kernel_rc", "contexts", "ctx_rc",
                                                     "mallocs_ok", "last_rc") if k in m)
            L.append(f"| {case} | {mode} | {(r or {}).get('limit_mib') or '–'} | {f(m.get('nvml_peak_mib'), 0)} | "
                     f"{f(m.get('over_limit_mib'), 0)} | {f(m.get('chunks'), 0)} | {det} {err_text(r)} | "
                     f"{f(m.get('met')) if 'met' in m else ''} |")
    L.append(f"\n## Start-up under contention ({START_RACERS} processes of the container racing "
             f"64 MiB allocations at a {START_LIMIT} MiB limit; medians of {START_ROUNDS} newcomers)\n")
    L.append("| mode | exec→main s | cuInit s | context s | first cuMemAlloc s | spawn → first answer s | "
             "goal (1.2 × native + 50 ms) | met |")
    L.append("|---|---|---|---|---|---|---|---|")
    for mode in doc["env"].get("modes", []):
        r = pick(runs, "startup", "startup", mode)
        m = (r or {}).get("metrics", {})
        L.append(f"| {mode} | {f(m.get('spawn_to_main_s'), 3)} | {f(m.get('init_s'), 3)} | {f(m.get('ctx_s'), 3)} | "
                 f"{f(m.get('first_alloc_s'), 4)} | {f(m.get('to_first_answer_s'), 3)} | {f(m.get('goal_s'), 3)} | "
                 f"{f(m.get('met')) if 'met' in m else ''} {err_text(r)} |")
    return "\n".join(L) + "\n"


def fmt_stats(s: dict[str, Any] | None) -> str:
    if not s or s.get("min") is None:
        return "–"
    return f"{s['min']:.0f}/{s['max']:.0f}/{s['sd']:.1f}"


def plot(doc: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.patches
    import matplotlib.pyplot as plt

    runs = doc["runs"]
    modes = [m for m in doc["env"].get("modes", []) if m != "native"]
    colors = {"hami": "tab:orange", "kvgpu": "tab:blue", "mps": "tab:green", "native": "tab:gray"}
    fig, ax = plt.subplots(2, 2, figsize=(16, 10))
    # (a) busy share per single workload
    labels: list[str] = []
    x = 0
    a = ax[0][0]
    for ident, _, limits in SINGLES:
        for lim in limits:
            nat = pick(runs, "single", ident, "native")
            nb = (nat or {}).get("metrics", {}).get("busy")
            for j, mode in enumerate(modes):
                r = pick(runs, "single", f"{ident}@{lim}", mode)
                v = (r or {}).get("metrics", {}).get("busy")
                if v is not None:
                    a.bar(x + j * 0.4 - 0.2, v, 0.38, color=colors.get(mode, "k"),
                          label=mode if not labels else None)
            tgt = min(lim, nb) if nb is not None else lim
            a.plot([x - 0.45, x + 0.45], [tgt, tgt], "k-", lw=2)
            if nb is not None:
                a.plot([x], [nb], "v", color="tab:gray")
            labels.append(f"{ident}\n@{lim}%")
            x += 1
    a.set_xticks(range(len(labels)), labels, fontsize=7)
    a.set_ylabel("card busy %  (black: target; ▼ native)")
    a.set_title("one tenant: busy share vs target")
    if a.patches:
        a.legend()
    # (b) per-second busy share, kvgpu and HAMi
    b = ax[0][1]
    for ident, _, limits in SINGLES:
        for lim in limits:
            for mode in modes:
                r = pick(runs, "single", f"{ident}@{lim}", mode)
                sec = (r or {}).get("metrics", {}).get("busy_sec") or []
                if sec:
                    b.plot(range(1, len(sec) + 1), sec, "-" if mode == "kvgpu" else ":", marker=".", alpha=0.7,
                           label=f"{ident}@{lim} {mode}")
    b.set_xlabel("second of the measured window")
    b.set_ylabel("busy %")
    b.set_title("per-second busy share (solid kvgpu, dotted HAMi-core)")
    if b.lines:
        b.legend(fontsize=6, ncol=2)
    # (c) co-tenants
    c = ax[1][0]
    labels = []
    x = 0
    for gid, tenants in GROUPS:
        for i, (pr, lim) in enumerate(tenants):
            for j, mode in enumerate(modes):
                r = pick(runs, "group", gid, mode)
                ts = (r or {}).get("metrics", {}).get("tenants") or []
                if i < len(ts) and ts[i].get("share") is not None:
                    c.bar(x + j * 0.4 - 0.2, ts[i]["share"], 0.38, color=colors.get(mode))
                if i < len(ts) and ts[i].get("expected") is not None and mode == "kvgpu":
                    c.plot([x - 0.45, x + 0.45], [ts[i]["expected"]] * 2, "k-", lw=2)
            labels.append(f"{gid}\n{chr(65 + i)} p{pr} {lim or '-'}%")
            x += 1
    c.set_xticks(range(len(labels)), labels, fontsize=6, rotation=60)
    c.set_ylabel("% of native single-tenant throughput")
    c.legend(handles=[matplotlib.patches.Patch(color=colors[m], label=m) for m in modes if m in colors])
    c.set_title("co-tenants (black: documented split)")
    # (d) memory peaks
    d = ax[1][1]
    labels = []
    x = 0
    for case in ("graphmem", "heap"):
        for mode in doc["env"].get("modes", []):
            r = pick(runs, "memory", case, mode)
            v = (r or {}).get("metrics", {}).get("nvml_peak_mib")
            if v is not None:
                d.bar(x, v, 0.7, color=colors.get(mode))
            lim = GRAPH_LIMIT if case == "graphmem" else HEAP_LIMIT
            d.plot([x - 0.4, x + 0.4], [lim, lim], "r-", lw=2)
            labels.append(f"{case}\n{mode}")
            x += 1
    d.set_xticks(range(len(labels)), labels, fontsize=7)
    d.set_ylabel("NVML per-process peak MiB (red: limit)")
    d.set_title("memory cases")
    fig.suptitle(f"kvgpu workload suite, {doc['env'].get('card', '')}, {doc['env'].get('date', '')}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


BULKY = ("marks", "done_ms", "lat_ms")


def slim_run(r: dict[str, Any]) -> dict[str, Any]:
    """A run without its samples and per-unit lists (those stay in raw.json)."""
    out = {k: v for k, v in r.items() if k != "samples"}
    if isinstance(r.get("result"), dict):
        out["result"] = {k: v for k, v in r["result"].items() if k not in BULKY}
    if "tenants" in r:
        out["tenants"] = [{**t, "result": {k: v for k, v in t["result"].items() if k not in BULKY}}
                          for t in r["tenants"]]
    return out


def write_outputs(doc: dict[str, Any], out: Path) -> None:
    analyze(doc["runs"], doc.get("_baseline", {}))
    slim = {k: v for k, v in doc.items() if k != "_baseline"}
    (out / "raw.json").write_text(json.dumps(rnd(slim, 4)))
    slim = {**slim, "runs": [slim_run(r) for r in slim["runs"]]}
    (out / "results.json").write_text(json.dumps(rnd(slim, 3), indent=1))
    (out / "summary.md").write_text(markdown(slim))
    try:
        plot(slim, out / "suite.png")
    except Exception as e:  # the numbers matter more than the picture
        (out / "plot-error.txt").write_text(repr(e))


# ------------------------------------------------------------------------------------ main


def plan(cfg: Config) -> list[tuple[str, Any]]:
    """(kind, args) in the order they run: the cheap memory and start-up cases first, then every
    workload alone (native first: it is the baseline and calibrates), then the co-tenants."""
    items: list[tuple[str, Any]] = []
    if "memory" in cfg.parts:
        for case in ("graphmem", "heap"):
            if cfg.wanted(case):
                items += [("memory", (case, m)) for m in cfg.modes]
    if "startup" in cfg.parts and cfg.wanted("startup"):
        items += [("startup", m) for m in cfg.modes]
    if "single" in cfg.parts:
        for ident, kind, limits in SINGLES:
            if not cfg.wanted(ident) and not (ident == "mm" and "group" in cfg.parts):
                continue
            if "native" in cfg.modes:
                items.append(("single", (ident, kind, "native", None)))
            for lim in limits:
                items += [("single", (ident, kind, m, lim)) for m in cfg.modes if m != "native"]
    if "group" in cfg.parts:
        if "native" in cfg.modes and "pair-native" in cfg.only:  # reference only: on request
            items.append(("group", ("pair-native", [(1, 0), (1, 0)], "native")))
        for gid, tenants in GROUPS:
            if cfg.wanted(gid):
                items += [("group", (gid, tenants, m)) for m in cfg.modes if m != "native"]
    return items


def cost(cfg: Config, kind: str, args: Any) -> float:
    if kind == "memory":
        return 4
    if kind == "startup":
        return 8
    if kind == "single":
        k = args[1]
        secs = cfg.secs * (1.5 if k in ("infer", "spin1", "spin10") else 1)
        return secs + (3 if k.startswith("spin") else 6) + (20 if k == "compile" and args[2] == "native" else 0)
    return cfg.secs + 7


class MpsDaemon:
    """Mode mps: one MPS control daemon for the card, with its own pipe and log folders (what
    kvgpu.agent.mps runs per card on a node), quit at the end."""

    def __init__(self, root: Path, uuid: str, fake: bool) -> None:
        self.root, self.fake = root, fake
        self.env = {**base_env(), "CUDA_VISIBLE_DEVICES": uuid, "CUDA_MPS_PIPE_DIRECTORY": str(root / "pipe"),
                    "CUDA_MPS_LOG_DIRECTORY": str(root / "log")}

    def start(self) -> str:
        """'' when the daemon runs, else why not."""
        for d in ("pipe", "log"):
            (self.root / d).mkdir(parents=True, exist_ok=True)
        if self.fake:
            return ""
        try:
            p = subprocess.run(["nvidia-cuda-mps-control", "-d"], env=self.env, capture_output=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired) as e:
            return f"nvidia-cuda-mps-control: {e}"
        return "" if p.returncode == 0 else f"nvidia-cuda-mps-control -d: rc {p.returncode} {p.stderr[-300:]!r}"

    def stop(self) -> None:
        if not self.fake:
            with contextlib.suppress(OSError, subprocess.TimeoutExpired):
                subprocess.run(["nvidia-cuda-mps-control"], input=b"quit\n", env=self.env, timeout=30)


def run_suite(cfg: Config, sampler: NvmlSampler) -> dict[str, Any]:
    mps = None
    if "mps" in cfg.modes:
        cfg.mps_dir = tempfile.mkdtemp(prefix="kvgpu-suite-mps-")
    try:
        sampler.start()
        cfg.uuid = cfg.uuid or sampler.uuid
        if "mps" in cfg.modes:
            mps = MpsDaemon(Path(cfg.mps_dir), cfg.uuid, cfg.fake)
            if why := mps.start():
                print(f"mode mps left out: {why}", file=sys.stderr)
                cfg.modes = [m for m in cfg.modes if m != "mps"]
        return _run_suite(cfg, sampler)
    finally:
        if mps is not None:
            mps.stop()


def _run_suite(cfg: Config, sampler: NvmlSampler) -> dict[str, Any]:
    cfg.out.mkdir(parents=True, exist_ok=True)
    runner = Runner(cfg, sampler)
    cfg.sched_dir = str(runner.tmp / "sched")
    Path(cfg.sched_dir).mkdir()
    why = "selftest" if cfg.fake else agent_available() if os.environ.get("SUITE_STATIC_SCHEDULE") != "1" else "off"
    if "kvgpu" in cfg.modes and not why:
        runner.agent = AgentSchedule(cfg.sched_dir, cfg.uuid)
    doc: dict[str, Any] = {"env": {
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "card": sampler.name, "uuid": cfg.uuid,
        "secs": cfg.secs, "modes": cfg.modes, "parts": cfg.parts, "only": sorted(cfg.only),
        "kvgpu_lib": os.path.basename(cfg.kvgpu_lib), "hami_lib": os.path.basename(cfg.hami_lib),
        "kvgpu_schedule": "the agent's Scheduler, every 250 ms" if runner.agent else
        f"the agent's layout(), written once per run ({why})"},
        "runs": [], "_baseline": cfg.baseline}
    if "hami" in cfg.modes and not (cfg.hami_lib and os.path.exists(cfg.hami_lib)) and not cfg.fake:
        doc["env"]["hami_error"] = "HAMI_LIB missing: HAMi-core did not build"
    native: dict[str, dict[str, Any]] = {}
    for r in cfg.baseline.get("runs", []):
        if r.get("mode") == "native" and r.get("section") == "single":
            native[r["id"]] = r
    for kind, args in plan(cfg):
        est = cost(cfg, kind, args)
        t_start = time.time()
        mode = None
        try:
            if kind == "memory":
                case, mode = args
                rec = ({"id": case, "section": "memory", "mode": mode, "skipped": "HAMi-core not built"}
                       if mode == "hami" and "hami_error" in doc["env"] else
                       {"id": case, "section": "memory", "mode": mode, "skipped": "time budget"}
                       if cfg.left_s() < est else runner.memory(case, mode))
            elif kind == "startup":
                mode = args
                rec = ({"id": "startup", "section": "startup", "mode": mode, "skipped": "HAMi-core not built"}
                       if mode == "hami" and "hami_error" in doc["env"] else
                       {"id": "startup", "section": "startup", "mode": mode, "skipped": "time budget"}
                       if cfg.left_s() < est else runner.startup(mode))
            elif kind == "single":
                ident, wk, mode, lim = args
                rid = ident if lim is None else f"{ident}@{lim}"
                if mode == "hami" and "hami_error" in doc["env"]:
                    rec = {"id": rid, "section": "single", "mode": mode, "limit": lim, "skipped": "HAMi-core not built"}
                elif cfg.left_s() < est:
                    rec = {"id": rid, "section": "single", "mode": mode, "limit": lim, "skipped": "time budget"}
                else:
                    nat = native.get(ident, {}).get("result", {})
                    calib = nat.get("calib") if wk == "infer" else nat.get("iters") if wk.startswith("spin") else None
                    if mode != "native" and wk in ("infer", "spin1", "spin10") and calib is None:
                        calib = 30 if wk == "infer" else 0  # no native calibration: the workload calibrates
                    rec = runner.single(ident, wk, mode, lim, calib)
                    rec["id"] = rid
                    if mode == "native":
                        native[ident] = rec
            else:
                gid, tenants, mode = args
                if mode == "hami" and "hami_error" in doc["env"]:
                    rec = {"id": gid, "section": "group", "mode": mode, "skipped": "HAMi-core not built"}
                elif cfg.left_s() < est:
                    rec = {"id": gid, "section": "group", "mode": mode, "skipped": "time budget"}
                else:
                    rec = runner.group(gid, tenants, mode)
        except Exception as e:  # one broken case must not cost the rest of the call
            rec = {"id": str(args[0]) if not isinstance(args, str) else "startup", "section": kind,
                   "mode": mode, "result": {"error": f"suite error: {e!r}"}}
        rec["wall_s"] = round(time.time() - t_start, 2)
        doc["runs"].append(rec)
        print(f"[{time.time() - cfg.t0:6.1f}s] {kind} {rec.get('id')} {rec.get('mode')}: "
              f"{rec.get('skipped') or (rec.get('result') or {}).get('error') or 'ok'} ({rec['wall_s']} s)",
              flush=True)
        doc["env"]["sample_period_s"] = sample_period(sampler.dev[-200:])
        doc["env"]["sampler_errors"] = dict(sampler.errors)
        doc["env"]["nvml_clock_offset_s"] = sampler.clock_offset_s
        (cfg.out / "raw.json").write_text(json.dumps({k: v for k, v in doc.items() if k != "_baseline"}))
    sampler.stop()
    if runner.agent:
        runner.agent.stop()
        doc["env"]["agent_errors"] = runner.agent.errors
    write_outputs(doc, cfg.out)
    shutil.rmtree(runner.tmp, ignore_errors=True)
    return doc


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out")
    ap.add_argument("--report")
    ap.add_argument("--merge", nargs="+", metavar="RAW_JSON",
                    help="one report of several calls' raw.json (a later call's run fills a skipped one)")
    ap.add_argument("--selftest", action="store_true")
    ap.add_argument("--fake-wl", nargs="+")
    ap.add_argument("--fake-cu", nargs="+")
    ap.add_argument("--calib")
    ap.add_argument("--ready")
    ap.add_argument("--go")
    a = ap.parse_args()
    if a.fake_wl:
        fake_wl(a.fake_wl[0], float(a.fake_wl[1]), a.calib, a.ready, a.go)
        return
    if a.fake_cu:
        fake_cu(a.fake_cu)
        return
    out = Path(a.out or os.environ.get("OUT") or ROOT / "bench/results/raw/suite")
    if a.merge:
        docs = [json.loads(Path(p).read_text()) for p in a.merge]
        merged: list[dict[str, Any]] = []
        doc = {"env": {**docs[0]["env"], "calls": [d["env"] for d in docs]}, "runs": merged}
        for i, d in enumerate(docs, 1):
            for r in d["runs"]:
                r["call"] = i
                same = [x for x in merged if (x["section"], x["id"], x.get("mode")) ==
                        (r["section"], r["id"], r.get("mode"))]
                if r.get("skipped") and same:
                    continue
                for x in same:
                    if x.get("skipped"):
                        merged.remove(x)
                merged.append(r)  # the tables show a call's first run; each call keeps its natives
        for r in merged:
            r.pop("metrics", None)
        out.mkdir(parents=True, exist_ok=True)
        write_outputs(doc, out)
        print((out / "summary.md").read_text())
        return
    if a.report:
        doc = json.loads(Path(a.report).read_text())
        for r in doc["runs"]:
            r.pop("metrics", None)
        out.mkdir(parents=True, exist_ok=True)
        if os.environ.get("BASELINE"):
            doc["_baseline"] = json.loads(Path(os.environ["BASELINE"]).read_text())
        write_outputs(doc, out)
        print((out / "summary.md").read_text())
        return
    cfg = Config.from_env(out, fake=a.selftest)
    run_suite(cfg, FakeSampler() if a.selftest else NvmlSampler())
    print((out / "summary.md").read_text())


if __name__ == "__main__":
    main()
