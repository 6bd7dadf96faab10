"""The workload suite's NVML sampler: a thread that reads the card's and each process's busy
share and memory through NVML (see suite.py)."""

from __future__ import annotations

import contextlib
import ctypes
import statistics
import struct
import threading
import time
from typing import Any

from suite_plan import MIB

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
