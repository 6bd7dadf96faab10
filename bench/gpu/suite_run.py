"""The workload suite's runner: the environment of each mode, the agent's schedule for
co-tenants, the MPS daemon, and the loop over the plan (see suite.py)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import suite_plan  # noqa: F401 (puts the tree under test on sys.path)
from kvgpu.agent.schedule import Tenant, encode, layout, limited, write_schedule
from suite_analysis import sample_period
from suite_fake import FakeSampler, fake_busy, fake_group_busy, fake_mem
from suite_nvml import NvmlSampler
from suite_plan import (
    COMPUTE_MEM_MIB,
    HERE,
    MEMORY_LIMITS,
    MIB,
    ONE_CONTAINER,
    ROOT,
    START_LIMIT,
    START_RACERS,
    START_RESERVE,
    START_ROUNDS,
    TREE,
    Config,
    cost,
    plan,
)
from suite_report import write_outputs

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
    schedule file every ``INTERVAL_S`` (100 ms), as the agent does on a node."""

    def __init__(self, sched_dir: str, uuid: str) -> None:
        from kvgpu.agent.schedule import INTERVAL_S, Scheduler, TenantSource

        self._interval = INTERVAL_S

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
            self._stop.wait(self._interval)

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
            cmd = [self.cfg.py, str(HERE / "suite.py"), "--fake-wl", kind, str(secs)]
        elif kind in ("spinctx2", "spinptds"):
            return [self.cfg.suite_cu, kind[4:], str(int(calib or 0)), str(secs)]
        elif kind == "spingrid1":
            return [self.cfg.suite_cu, "spingrid", str(int(calib or 0)), str(secs), "1"]
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
            return [self.cfg.py, str(HERE / "suite.py"), "--fake-cu", *args]
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
        secs = self.cfg.secs * (1.5 if kind in ("infer", "spin1", "spin10", "spingrid1") else 1.0)
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
        if ident in ONE_CONTAINER:  # processes of one container: one claim and region for all
            pr, c = tenants[0]
            ts = [self.container(f"{ident}-{mode}", COMPUTE_MEM_MIB, c if mode != "native" else 0, pr)] * len(tenants)
            sched = self.sched(mode, ts[:1])
        else:
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
                self.s.busy[p.pid] = fake_group_busy(tenants, i, mode, ident in ONE_CONTAINER)
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
            "schedule": self.sched_seen(sched) if mode == "kvgpu" else [], "secs": secs,
            "one_container": ident in ONE_CONTAINER}
        t0s = [r["t0"] for r in results if "t0" in r]
        t1s = [r["t1"] for r in results if "t1" in r]
        if t0s and t1s:
            rec["window"] = [max(t0s), min(t1s)]
            rec["samples"] = self.s.window(min(t0s), max(t1s))
        return rec

    # -- memory cases
    def memory(self, case: str, mode: str) -> dict[str, Any]:
        limit = MEMORY_LIMITS[case]
        maxn = "8" if mode == "native" else "40"
        t = self.container(f"{case}-{mode}", limit, 0)
        args = {"graphmem": ["graphmem", str(2 << 30), str(256 * MIB), maxn, "1.0"],
                "heap": ["heap", str(1 << 30), str(128 << 10), "3", str(256 * MIB), maxn, "1.0"],
                "green": ["green", "16", str(256 * MIB), maxn, "1.0"]}[case]
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
            p, out = self.spawn(tag, self.cu_cmd("racer", str(64 * MIB), str(cap), str(racer_secs), str(go),
                                                   str(START_RESERVE * MIB)), mode, t)
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



class MpsDaemon:
    """Mode mps: one MPS control daemon for the card, with its own pipe and log folders (what
    kvgpu.agent.mps runs per card on a node), quit after every mps run and started again for the
    next: the MPS server it starts for the first client stays on the card after the last one
    exits, and a kvgpu tenant run after it is then not alone on the card (its shim calibrates
    against NVML only alone: conv ran 3.5 points under 30 % after an mps run, on target without
    one)."""

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

    def restart(self) -> str:
        """Quit the daemon and its server, and start it again ('' when it runs)."""
        self.stop()
        return self.start()


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
        return _run_suite(cfg, sampler, mps)
    finally:
        if mps is not None:
            mps.stop()


def _run_suite(cfg: Config, sampler: NvmlSampler, mps: MpsDaemon | None = None) -> dict[str, Any]:
    cfg.out.mkdir(parents=True, exist_ok=True)
    runner = Runner(cfg, sampler)
    cfg.sched_dir = str(runner.tmp / "sched")
    Path(cfg.sched_dir).mkdir()
    why = "selftest" if cfg.fake else agent_available() if os.environ.get("SUITE_STATIC_SCHEDULE") != "1" else "off"
    if "kvgpu" in cfg.modes and not why:
        runner.agent = AgentSchedule(cfg.sched_dir, cfg.uuid)
    doc: dict[str, Any] = {"env": {
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "card": sampler.name, "uuid": cfg.uuid,
        "secs": cfg.secs, "modes": cfg.modes, "parts": cfg.parts, "only": sorted(cfg.only), "limits": cfg.limits,
        "kvgpu_lib": os.path.basename(cfg.kvgpu_lib), "hami_lib": os.path.basename(cfg.hami_lib),
        "kvgpu_schedule": "the agent's Scheduler, every 100 ms" if runner.agent else
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
                    if mode != "native" and wk in ("infer", "spin1", "spin10", "spingrid1") and calib is None:
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
        if mode == "mps" and mps is not None and (why := mps.restart()):
            print(f"MPS daemon did not start again: {why}", file=sys.stderr)
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
