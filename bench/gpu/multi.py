#!/usr/bin/env python3
"""Issue 20's multi-card checks under the shim, natively beside it; see bench/gpu/multi.sh.

    python3 bench/gpu/multi.py --out DIR --lib shim/_build/libvgpu.so   on the GPU machine
    python3 bench/gpu/multi.py --selftest [--out DIR]                   anywhere: fakes, no GPU

Parts (issue 20 item 1): 1 a claim over the first two cards (``--slices``, default 3000 MiB /
30 % and 6000 MiB / 50 %): per card mem_get_info, 256 MiB blocks until CUDA's OOM, NVML's
per-process peak, nvidia-smi under the preload, a matmul loop on every card at once (one
process per card, then one process with a thread per card) against the same loop natively;
2 CUDA_VISIBLE_DEVICES by index, reordered, by UUID (full, without ``GPU-``, abbreviated): per
visible ordinal the UUID as natively and its own slice; 3 torchrun all-reduce of 128 floats
between two processes under the claim, 60 s at most; 4 peer access and a cross-card copy as
natively; 5 bench/gpu/discovery_check.py. With one card the 2-card checks are recorded as
skipped. Writes DIR/multi.json (every check), DIR/multi.md, DIR/raw/ (each child's output);
exit 0 only when every check that ran passed. Units: MiB, percent, seconds.

The probes are multi_probe.py (torch); the verdicts and the report multi_judge.py (pure); the
fakes of --selftest multi_fake.py.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

import multi_judge as J
from multi_judge import Card, Env

HERE = Path(__file__).resolve().parent
PROBE = HERE / "multi_probe.py"
DISCOVERY = HERE / "discovery_check.py"
BASE_ENV = {"NCCL_NVLS_ENABLE": "0", "CUDA_DEVICE_ORDER": "PCI_BUS_ID", "PYTHONUNBUFFERED": "1"}


class Runner(Protocol):
    """What the checks need from a machine: the real one (Real) or multi_fake.FakeMachine."""

    def cards(self) -> list[Card]: ...
    def probe(self, label: str, kind: str, env: Env, args: list[str], timeout: float) -> dict[str, Any]: ...
    def matmul_procs(self, label: str, env: Env, devices: list[int], secs: float) -> dict[str, Any]: ...
    def smi(self, label: str, env: Env, indices: list[int]) -> dict[str, Any]: ...
    def torchrun(self, label: str, env: Env, nproc: int, timeout: float) -> dict[str, Any]: ...
    def discovery(self, label: str) -> dict[str, Any]: ...


@dataclass
class Setup:
    """The run's parameters: the machine's cards, the slices (MiB, cores %) of card 0 and 1."""

    cards: list[Card]
    lib: str
    tmp: Path
    slices: list[tuple[int, int]] = field(default_factory=lambda: [(3000, 30), (6000, 50)])
    secs: float = 8.0
    tol: float = 5.0
    block: int = 256

    @property
    def claimed(self) -> list[Card]:
        """The cards in the claim: the first two (or the only one)."""
        return self.cards[:2]

    def claim(self) -> str:
        """The KVGPU_CLAIM string over the claimed cards."""
        devs = [f"dev={c.uuid},{m},{k}" for c, (m, k) in zip(self.claimed, self.slices, strict=False)]
        return ";".join(["v1", "claim=bench/multi", "priority=1", *devs])

    def slice_mib(self) -> dict[str, int]:
        """UUID key -> the slice's MiB, for the claimed cards."""
        return {J.uuid_key(c.uuid): m for c, (m, _) in zip(self.claimed, self.slices, strict=False)}

    def cvd_all(self) -> str | None:
        """CUDA_VISIBLE_DEVICES for the parts that use every claimed card: unset unless the
        machine has more cards than the claim."""
        if len(self.cards) <= 2:
            return None
        return ",".join(str(c.index) for c in self.claimed)

    def native(self, cvd: str | None = None) -> Env:
        """The environment of a native run."""
        return {"LD_PRELOAD": None, "KVGPU_CLAIM": None, "KVGPU_CLAIM_FILE": None, "CUDA_VISIBLE_DEVICES": cvd}

    def shim(self, tag: str, cvd: str | None = None) -> Env:
        """The environment of one container under the claim: a fresh region per ``tag``."""
        region = self.tmp / f"region-{tag}"
        region.mkdir(parents=True, exist_ok=True)
        (self.tmp / "sched").mkdir(exist_ok=True)
        return {**self.native(cvd), "LD_PRELOAD": self.lib, "KVGPU_CLAIM": self.claim(),
                "KVGPU_REGION_DIR": str(region), "KVGPU_SCHED_DIR": str(self.tmp / "sched")}


# --- part 1 ------------------------------------------------------------------------------

def part_claim_memory(r: Runner, s: Setup) -> list[J.Check]:
    """Each claimed card's total, limit and NVML peak in one process; nvidia-smi's view."""
    res = r.probe("claim-mem", "mem", s.shim("claim", s.cvd_all()), ["--block", str(s.block)], 300)
    smi = r.smi("claim-smi", s.shim("claim", s.cvd_all()), [c.index for c in s.claimed])
    out: list[J.Check] = []
    for i, (mib, _) in enumerate(s.slices):
        names = (f"claim.mem.card{i}", f"claim.nvml.card{i}", f"claim.smi.card{i}")
        if i >= len(s.claimed):
            out += [J.skip(names[0], 1, J.mem_expected(mib, s.block)),
                    J.skip(names[1], 1, f"NVML per-process peak <= {mib} MiB"),
                    J.skip(names[2], 1, f"memory.total {mib} MiB")]
            continue
        dev = J.device_by_uuid(res, s.claimed[i].uuid)
        if dev is None and J.probe_error(res):
            dev = {"error": J.probe_error(res)}
        out += [J.judge_mem_device(names[0], 1, dev, mib, s.block),
                J.judge_nvml_peak(names[1], 1, dev, mib),
                J.judge_smi_card(names[2], 1, smi.get("query", ""), s.claimed[i].uuid, mib)]
    mibs = [m for m, _ in s.slices[: len(s.claimed)]]
    out.append(J.judge_smi_table("claim.smi.table", 1, smi.get("table", ""), mibs))
    return out


def part_claim_compute(r: Runner, s: Setup) -> list[J.Check]:
    """Matmul on every claimed card at once, natively then under the claim: the share of each
    card's native rate, first with one process per card, then one process with a thread per card."""
    devs, cvd = list(range(len(s.claimed))), s.cvd_all()
    args = ["--secs", str(s.secs)]
    runs = {
        "compute": (r.matmul_procs("mm-native", s.native(cvd), devs, s.secs),
                    r.matmul_procs("mm-claim", s.shim("mm", cvd), devs, s.secs)),
        "compute1p": (r.probe("mm1p-native", "matmul", s.native(cvd), args, s.secs + 300),
                      r.probe("mm1p-claim", "matmul", s.shim("mm1p", cvd), args, s.secs + 300)),
    }
    out: list[J.Check] = []
    for what, (nat, shim) in runs.items():
        for i, (_, cores) in enumerate(s.slices):
            name = f"claim.{what}.card{i}"
            if i >= len(s.claimed):
                out.append(J.skip(name, 1, J.compute_expected(cores, s.tol)))
                continue
            u, err = s.claimed[i].uuid, J.probe_error(nat) or J.probe_error(shim)
            out.append(J.judge_share(name, 1, J.rate_by_uuid(nat, u), J.rate_by_uuid(shim, u), cores, s.tol, err))
    return out


# --- part 2 ------------------------------------------------------------------------------

# (label, [(claimed card, how it is written)], accepted natively for sure)
CVD_FORMS: list[tuple[str, list[tuple[int, str]], bool]] = [
    ("0", [(0, "index")], True),
    ("uuid0", [(0, "uuid")], True),
    ("short0", [(0, "short")], True),
    ("bare0", [(0, "bare")], False),
    ("1", [(1, "index")], True),
    ("1,0", [(1, "index"), (0, "index")], True),
    ("uuid1", [(1, "uuid")], True),
    ("uuid1,uuid0", [(1, "uuid"), (0, "uuid")], True),
    ("short1,short0", [(1, "short"), (0, "short")], True),
    ("bare1,bare0", [(1, "bare"), (0, "bare")], False),
]


def cvd_token(c: Card, how: str) -> str:
    """One CUDA_VISIBLE_DEVICES entry: index, ``GPU-<uuid>``, ``<uuid>``, ``GPU-<8 hex>``."""
    return {"index": str(c.index), "uuid": c.uuid, "bare": J.uuid_key(c.uuid),
            "short": "GPU-" + J.uuid_key(c.uuid)[:8]}[how]


def part_cvd(r: Runner, s: Setup) -> list[J.Check]:
    """Each CUDA_VISIBLE_DEVICES form natively (which card is which ordinal) and under the claim
    (each ordinal's total and limit, from its slice)."""
    out: list[J.Check] = []
    for k, (label, toks, sure) in enumerate(CVD_FORMS):
        name, mibs = f"cvd.{label}", [s.slices[i][0] for i, _ in toks]
        if max(i for i, _ in toks) >= len(s.claimed):
            out.append(J.skip(name, 2, J.cvd_expected(mibs)))
            continue
        cvd = ",".join(cvd_token(s.claimed[i], how) for i, how in toks)
        nat = r.probe(f"cvd-{label}-native", "view", s.native(cvd), [], 120)
        shim = r.probe(f"cvd-{label}-claim", "mem", s.shim(f"cvd{k}", cvd), ["--block", str(s.block)], 300)
        c = J.judge_cvd(name, nat, shim, s.slice_mib(), mibs, s.block, allow_none=not sure)
        c.data["CUDA_VISIBLE_DEVICES"] = cvd
        out.append(c)
    return out


# --- parts 3, 4, 5 -----------------------------------------------------------------------

def part_allreduce(r: Runner, s: Setup) -> list[J.Check]:
    """torchrun, 2 processes, NCCL all-reduce: natively (shown), then under the claim."""
    if len(s.claimed) < 2:
        return [J.skip("allreduce.claim", 3, J.allreduce_expected(2))]
    lim = J.ALLREDUCE_LIMIT_S
    nat = r.torchrun("allreduce-native", s.native(s.cvd_all()), 2, lim)
    shim = r.torchrun("allreduce-claim", s.shim("nccl", s.cvd_all()), 2, lim)
    return J.judge_allreduce(nat, shim)


def part_peer(r: Runner, s: Setup) -> list[J.Check]:
    """Peer access and a copy between the two claimed cards, natively and under the claim."""
    if len(s.claimed) < 2:
        return [J.skip("peer.can_access", 4, "as natively"), J.skip("peer.copy", 4, "as natively")]
    nat = r.probe("peer-native", "peer", s.native(s.cvd_all()), [], 120)
    shim = r.probe("peer-claim", "peer", s.shim("peer", s.cvd_all()), [], 120)
    return J.judge_peer(nat, shim)


def part_discovery(r: Runner, s: Setup) -> list[J.Check]:
    """The node agent's NVML discovery against nvidia-smi, every card of the machine."""
    return [J.judge_discovery(r.discovery("discovery"), len(s.cards))]


PARTS = (part_claim_memory, part_claim_compute, part_cvd, part_allreduce, part_peer, part_discovery)


def run_plan(r: Runner, s: Setup) -> list[J.Check]:
    """Every part in order; a part that raises becomes one failed check."""
    if not s.cards:
        return [J.verdict("cards", 0, ">= 1 card listed by nvidia-smi", "none", False)]
    out: list[J.Check] = []
    for part in PARTS:
        try:
            out += part(r, s)
        except Exception as e:  # report it, run the rest
            out.append(J.verdict(part.__name__, 0, "the part runs", f"{type(e).__name__}: {e}", False))
    return out


def write_report(checks: list[J.Check], s: Setup, out: Path, machine: str) -> int:
    """multi.json and multi.md in ``out``; returns the exit status."""
    meta = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "machine": machine,
            "n_cards": len(s.cards), "cards": [asdict(c) for c in s.cards], "command": " ".join(sys.argv),
            "claim": s.claim() if s.cards else "", "secs": s.secs, "tolerance_points": s.tol}
    doc = J.report_json(checks, meta)
    out.mkdir(parents=True, exist_ok=True)
    (out / "multi.json").write_text(json.dumps(doc, indent=2) + "\n")
    (out / "multi.md").write_text(J.report_md(checks, meta))
    return int(doc["exit"])


# --- the real machine --------------------------------------------------------------------

class Real:
    """Runs each probe as a child process; its stdout and stderr go to ``out``/raw/."""

    def __init__(self, out: Path, py: str) -> None:
        self.raw, self.py, self.seq = out / "raw", py, 0
        self.raw.mkdir(parents=True, exist_ok=True)

    def _start(self, label: str, cmd: list[str], over: Env) -> tuple[subprocess.Popen[str], Path]:
        self.seq += 1
        log = self.raw / f"{self.seq:02d}-{label}.log"
        env = {**os.environ, **BASE_ENV}
        for k, v in over.items():
            if v is None:
                env.pop(k, None)
            else:
                env[k] = v
        sets = " ".join(f"{k}={v}" for k, v in over.items() if v is not None)
        log.write_text(f"$ {sets} {' '.join(cmd)}\n")
        with log.open("a") as f:
            p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=f, text=True, start_new_session=True)
        return p, log

    @staticmethod
    def _finish(p: subprocess.Popen[str], log: Path, timeout: float) -> tuple[int, str]:
        """(exit status, stdout); 124 after ``timeout`` s, the whole process group killed."""
        try:
            out, _ = p.communicate(timeout=timeout)
            rc = p.returncode
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            out, rc = p.communicate()[0], 124
        with log.open("a") as f:
            f.write(f"\n--- stdout (rc {rc})\n{out}\n")
        return rc, out

    def _run(self, label: str, cmd: list[str], over: Env, timeout: float) -> tuple[int, str, float]:
        t0 = time.monotonic()
        rc, out = self._finish(*self._start(label, cmd, over), timeout)
        return rc, out, time.monotonic() - t0

    @staticmethod
    def _json(rc: int, out: str, log: str) -> dict[str, Any]:
        for line in reversed(out.strip().splitlines()):
            if line.startswith("{"):
                return dict(json.loads(line))
        why = "timed out" if rc == 124 else f"rc {rc}"
        return {"error": f"{why}, no result (see raw/{log})"}

    def cards(self) -> list[Card]:
        q = "--query-gpu=index,uuid,name,memory.total"
        try:
            text = subprocess.run(["nvidia-smi", q, "--format=csv,noheader,nounits"], capture_output=True,
                                  text=True, check=True, timeout=60).stdout
        except (OSError, subprocess.SubprocessError) as e:
            print(f"nvidia-smi failed: {e}", file=sys.stderr)
            return []
        return [Card(int(f[0]), f[1], f[2], int(f[3])) for f in
                ([x.strip() for x in ln.split(",")] for ln in text.strip().splitlines())]

    def probe(self, label: str, kind: str, env: Env, args: list[str], timeout: float) -> dict[str, Any]:
        rc, out, _ = self._run(label, [self.py, str(PROBE), kind, *args], env, timeout)
        return self._json(rc, out, f"{self.seq:02d}-{label}.log")

    def matmul_procs(self, label: str, env: Env, devices: list[int], secs: float) -> dict[str, Any]:
        sync = Path(tempfile.mkdtemp(prefix="mm-"))
        procs = [self._start(f"{label}-{d}", [self.py, str(PROBE), "matmul", "--secs", str(secs),
                                              "--device", str(d), "--sync", str(sync)], env) for d in devices]
        end = time.monotonic() + 300
        while (time.monotonic() < end and not all((sync / f"{d}.ready").exists() for d in devices)
               and all(p.poll() is None for p, _ in procs)):
            time.sleep(0.01)
        (sync / "go").touch()
        devs: list[dict[str, Any]] = []
        errors: list[str] = []
        for p, log in procs:
            rc, out = self._finish(p, log, secs + 120)
            res = self._json(rc, out, log.name)
            devs += res.get("devices", [])
            errors += [J.probe_error(res)] if J.probe_error(res) else []
        return {"devices": devs, "error": "; ".join(errors)}

    def smi(self, label: str, env: Env, indices: list[int]) -> dict[str, Any]:
        ids = ["-i", ",".join(map(str, indices))]
        q = ["--query-gpu=index,uuid,memory.used,memory.total", "--format=csv,noheader,nounits"]
        rc1, query, _ = self._run(label + "-query", ["nvidia-smi", *ids, *q], env, 60)
        rc2, table, _ = self._run(label + "-table", ["nvidia-smi", *ids], env, 60)
        return {"query": query, "table": table, "rc": [rc1, rc2]}

    def torchrun(self, label: str, env: Env, nproc: int, timeout: float) -> dict[str, Any]:
        res = Path(tempfile.mkdtemp(prefix="nccl-"))
        cmd = [self.py, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
               str(PROBE), "allreduce", "--result", str(res)]
        rc, _, secs = self._run(label, cmd, env, timeout)
        ranks = [json.loads(p.read_text()) for p in sorted(res.glob("rank*.json"))]
        return {"rc": rc, "secs": round(secs, 2), "nproc": nproc, "ranks": ranks,
                "error": f"killed after {timeout:g} s" if rc == 124 else ""}

    def discovery(self, label: str) -> dict[str, Any]:
        inv = self.raw.parent / "inventory.json"
        rc, out, _ = self._run(label, [self.py, str(DISCOVERY), "--json", str(inv)], {}, 180)
        return {"rc": rc, "text": out}


# --- entry points ------------------------------------------------------------------------

def parse_slices(text: str) -> list[tuple[int, int]]:
    """``3000:30,6000:50`` -> [(3000, 30), (6000, 50)]: MiB and cores % of card 0 and 1."""
    out = [(int(m), int(c)) for m, c in (x.split(":") for x in text.split(","))]
    if len(out) != 2 or any(m < 1 or not 0 <= c <= 100 for m, c in out):
        raise SystemExit(f"--slices {text!r}: two MiB:cores pairs, MiB >= 1, cores 0..100")
    return out


def run_real(a: argparse.Namespace) -> int:
    """The checks on this machine's cards."""
    out, slices = Path(a.out), parse_slices(a.slices)
    r = Real(out, a.python)
    cards = r.cards()
    lib = str(Path(a.lib).resolve())
    s = Setup(cards, lib, Path(tempfile.mkdtemp(prefix="kvgpu-multi-")), slices, a.secs, a.tol, a.block)
    machine = f"{socket.gethostname()}: {len(cards)} x {cards[0].name if cards else 'no card'}"
    checks = run_plan(r, s)
    rc = write_report(checks, s, out, machine)
    print((out / "multi.md").read_text())
    return rc


def selftest(out: Path) -> int:
    """The plan and the report on fake machines (multi_fake.SCENARIOS): 0 when each scenario's
    checks end as that scenario says."""
    from multi_fake import SCENARIOS, FakeMachine

    bad = 0
    for name, (n, bugs, want) in SCENARIOS.items():
        fm = FakeMachine(n, bugs)
        s = Setup(fm.cards(), "libvgpu.so", Path(tempfile.mkdtemp(prefix="multi-selftest-")), secs=1.0)
        checks = run_plan(fm, s)
        rc = write_report(checks, s, out / name, f"fake, {n} x NVIDIA H200, bugs {sorted(bugs) or 'none'}")
        problems = want(checks, rc)
        bad += bool(problems)
        print(f"{'ok  ' if not problems else 'FAIL'} {name}: exit {rc}, {J.summarize(checks)}"
              + "".join(f"\n     {p}" for p in problems))
    return 1 if bad else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "bench/results/raw/multi"))
    ap.add_argument("--lib", default=os.environ.get("KVGPU_LIB", "shim/_build/libvgpu.so"))
    ap.add_argument("--python", default=sys.executable, help="the Python with torch for the probes")
    ap.add_argument("--slices", default="3000:30,6000:50", help="MiB:cores%% of card 0 and card 1")
    ap.add_argument("--secs", type=float, default=8.0, help="seconds of each matmul run")
    ap.add_argument("--tol", type=float, default=5.0, help="points a share may be off its limit")
    ap.add_argument("--block", type=int, default=256, help="MiB per tensor in the memory probes")
    ap.add_argument("--selftest", action="store_true", help="fake machines, no GPU, no torch")
    a = ap.parse_args()
    if a.selftest:
        return selftest(Path(a.out) / "selftest")
    return run_real(a)


if __name__ == "__main__":
    sys.exit(main())
