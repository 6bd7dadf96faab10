"""What the scale bench measures besides the pods' own timestamps (:mod:`bench.scale.run`): CPU
seconds and RSS of the operator and its neighbours (``/proc``, sampled in a thread), the
operator's admission workers, the load average, the extender's latency histogram from the
operator's ``/metrics``, kube-apiserver's request counters, and the quantiles of both.
"""

from __future__ import annotations

import os
import threading
import time
import urllib.request
from pathlib import Path

from kubernetes_asyncio import client


class ProcSampler:
    """Samples CPU seconds and RSS of some PIDs every ``period`` seconds in a thread."""

    def __init__(self, pids: dict[str, int] | int, period: float = 0.5) -> None:
        self.pids = pids if isinstance(pids, dict) else {"operator": pids}
        self.period = period
        self.samples: dict[str, list[tuple[float, float, int]]] = {k: [] for k in self.pids}
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._tick = os.sysconf("SC_CLK_TCK")

    def read(self, pid: int | None = None) -> tuple[float, int]:
        pid = pid if pid is not None else next(iter(self.pids.values()))
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        cpu = (int(fields[11]) + int(fields[12])) / self._tick  # utime + stime, all threads
        rss = 0
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    rss = int(line.split()[1]) * 1024
        return cpu, rss

    def _sample(self) -> None:
        t = time.monotonic()
        for name, pid in self.pids.items():
            try:
                cpu, rss = self.read(pid)
            except OSError:
                continue
            self.samples[name].append((t, cpu, rss))

    def add(self, name: str, pid: int) -> None:
        """Sample one more process from now on (a scheduler restarted during the burst)."""
        self.samples[name] = []
        self.pids = {**self.pids, name: pid}

    def _run(self) -> None:
        while not self._stop.is_set():
            self._sample()
            self._stop.wait(self.period)

    def __enter__(self) -> ProcSampler:
        self._t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._t.join()
        self._sample()

    def summary(self, name: str = "operator") -> dict[str, float]:
        ss = self.samples.get(name) or []
        if len(ss) < 2:
            return {}
        (t0, c0, _), (t1, c1, _) = ss[0], ss[-1]
        return {"cpu_seconds": round(c1 - c0, 2), "cpu_cores_avg": round((c1 - c0) / max(t1 - t0, 1e-9), 3),
                "rss_mib_peak": round(max(s[2] for s in ss) / 2**20, 1),
                "rss_mib_end": round(ss[-1][2] / 2**20, 1)}

    def mark(self) -> float:
        """Read every process now (between the periodic samples) and return that reading's
        time: :meth:`cpu_by_process` ``since`` it counts from this reading exactly."""
        self._sample()
        return max((ss[-1][0] for ss in self.samples.values() if ss), default=time.monotonic())

    def cpu_by_process(self, since: float | None = None) -> dict[str, float]:
        """CPU seconds per sampled process over the sampling window, or from its last reading at
        or before ``since`` (a :meth:`mark`; a process first read later counts from its first)."""
        out = {}
        for name, ss in self.samples.items():
            before = [s for s in ss if since is not None and s[0] <= since]
            first = before[-1] if before else (ss[0] if ss else None)
            if first is not None and len(ss) >= 2:
                out[name] = round(ss[-1][1] - first[1], 2)
        return out


def webhook_workers(pid: int) -> list[int]:
    """The operator's admission worker processes (its children, less multiprocessing's helpers)."""
    kids: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            kids += [int(x) for x in (task / "children").read_text().split()]
        except OSError:
            continue
    out = []
    for k in sorted(set(kids)):
        try:
            cmd = Path(f"/proc/{k}/cmdline").read_bytes()
        except OSError:
            continue
        if b"resource_tracker" not in cmd:
            out.append(k)
    return out


def load_average() -> float:
    with open("/proc/loadavg") as f:
        return float(f.read().split()[0])


#: The key of :func:`scrape_histogram`'s answer that holds ``kvgpu_extender_connections_total``
#: (TLS connections the extender accepted), as ``{0.0: count}``.
CONNECTIONS = "connections"


def scrape_histogram(port: int) -> dict[str, dict[float, float]]:
    """Cumulative bucket counts of kvgpu_extender_request_seconds per verb, and under
    :data:`CONNECTIONS` the extender's TLS connections so far (one scrape: at 5,000 nodes a
    scrape costs the operator ~0.3 s of CPU)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=60) as r:
        text = r.read().decode()
    out: dict[str, dict[float, float]] = {}
    for line in text.splitlines():
        if line.startswith("kvgpu_extender_connections_total "):
            out[CONNECTIONS] = {0.0: float(line.rsplit(" ", 1)[1])}
        if not line.startswith("kvgpu_extender_request_seconds_bucket{"):
            continue
        labels, value = line[line.index("{") + 1:line.index("}")], float(line.rsplit(" ", 1)[1])
        kv = dict(p.split("=", 1) for p in labels.split(","))
        verb, le = kv["verb"].strip('"'), kv["le"].strip('"')
        out.setdefault(verb, {})[float("inf") if le == "+Inf" else float(le)] = value
    return out


#: The key prefix of admission webhook calls in :func:`api_requests` (not API requests).
WEBHOOK = "webhook "


async def api_requests(api: client.ApiClient) -> dict[str, float]:
    """kube-apiserver's own count of the requests it served (``apiserver_request_total``), summed
    per "VERB resource[/subresource]"; watches and the /metrics scrape itself left out. Also the
    admission webhook calls it made, per webhook (``apiserver_admission_webhook_admission_duration_seconds``'s
    count), as "webhook <name>"."""
    resp = await api.call_api("/metrics", "GET", auth_settings=["BearerToken"], _preload_content=False)
    try:
        text = (await resp.read()).decode()
    finally:
        resp.release()
    out: dict[str, float] = {}
    for line in text.splitlines():
        hook = line.startswith("apiserver_admission_webhook_admission_duration_seconds_count{")
        if not (hook or line.startswith("apiserver_request_total{")):
            continue
        labels, value = line[line.index("{") + 1:line.rindex("}")], float(line.rsplit(" ", 1)[1])
        kv = {k: v.strip('"') for k, v in (p.split("=", 1) for p in labels.split('",') if "=" in p)}
        if hook:
            key = WEBHOOK + kv.get("name", "")
            out[key] = out.get(key, 0.0) + value
            continue
        verb, res, sub = kv.get("verb", ""), kv.get("resource", ""), kv.get("subresource", "")
        if verb in ("WATCH", "CONNECT") or not res:
            continue
        key = f"{verb} {res}{'/' + sub if sub else ''}"
        out[key] = out.get(key, 0.0) + value
    return out


def per_pod_requests(before: dict[str, float], after: dict[str, float], pods: int,
                     *, webhooks: bool = False) -> dict[str, float]:
    """API requests per pod during a burst, by "VERB resource", largest first (≥ 0.01 per pod);
    with ``webhooks`` the admission webhook calls per pod by webhook name instead."""
    d = {k: (v - before.get(k, 0.0)) / max(pods, 1) for k, v in after.items()
         if k.startswith(WEBHOOK) == webhooks}
    if webhooks:
        d = {k[len(WEBHOOK):]: v for k, v in d.items()}
    return {k: round(v, 2) for k, v in sorted(d.items(), key=lambda kv: -kv[1]) if v >= 0.01}


def apiserver_cpu_ms_per_pod(cpu_by_process: dict[str, float], pods: int) -> float | None:
    """kube-apiserver's CPU time per pod of the burst (ms): its CPU seconds over the burst's
    window (from the first create to the last pod done) divided by the pods."""
    cpu = cpu_by_process.get("kube-apiserver")
    return None if cpu is None else round(cpu * 1000 / max(pods, 1), 2)


def cpu_ms_per_pod(cpu_by_process: dict[str, float], pods: int, *, each: bool = False
                   ) -> float | dict[str, float]:
    """All sampled processes' CPU time per pod (ms); ``each``: per process, with ``total``."""
    per = {k: round(v * 1000 / max(pods, 1), 2) for k, v in cpu_by_process.items()}
    total = round(sum(cpu_by_process.values()) * 1000 / max(pods, 1), 2)
    return {**per, "total": total} if each else total


def histogram_quantiles(before: dict[str, dict[float, float]], after: dict[str, dict[float, float]]
                        ) -> dict[str, dict[str, float]]:
    """p50/p99 (ms, linear inside the bucket) and the share ≤ 20 ms of each verb's delta."""
    res: dict[str, dict[str, float]] = {}
    for verb, buckets in after.items():
        if verb == CONNECTIONS:
            continue
        b0 = before.get(verb, {})
        les = sorted(buckets)
        cum = [buckets[le] - b0.get(le, 0.0) for le in les]
        total = cum[-1] if cum else 0
        if total <= 0:
            continue

        def q(p: float, les: list[float] = les, cum: list[float] = cum, total: float = total) -> float:
            want = p * total
            prev_le, prev_c = 0.0, 0.0
            for le, c in zip(les, cum, strict=True):
                if c >= want:
                    if le == float("inf"):
                        return prev_le * 1000
                    frac = (want - prev_c) / (c - prev_c) if c > prev_c else 1.0
                    return (prev_le + (le - prev_le) * frac) * 1000
                prev_le, prev_c = le, c
            return prev_le * 1000

        le20 = next((c for le, c in zip(les, cum, strict=True) if abs(le - 0.02) < 1e-12), float("nan"))
        res[verb] = {"count": int(total), "p50_ms": round(q(0.5), 2), "p99_ms": round(q(0.99), 2),
                     "share_le_20ms": round(le20 / total, 4)}
    return res


def new_connections(before: dict[str, dict[float, float]], after: dict[str, dict[float, float]]) -> float:
    """TLS connections the extender accepted between two :func:`scrape_histogram` answers."""
    return after.get(CONNECTIONS, {}).get(0.0, 0.0) - before.get(CONNECTIONS, {}).get(0.0, 0.0)


def pct(xs: list[float], p: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(p * (len(s) - 1))))]
