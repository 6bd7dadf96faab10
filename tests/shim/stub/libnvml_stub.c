/*
 * Stub libnvidia-ml.so.1: the same cards as libcuda_stub.c (shared state, stub_state.h).
 * Memory info v1/v2 and per-process usage read the processes' rows; NULL out-pointers return
 * NVML_ERROR_INVALID_ARGUMENT as the real library does. Utilization samples
 * (nvmlDeviceGetSamples, NVML_GPU_UTILIZATION_SAMPLES): one sample per call, the card's busy
 * share since this process's previous call from every process's GPU time, times
 * STUB_NVML_BUSY_PM / 1000 (default 1000: a card whose utilization counter counts exactly the
 * kernels' time; less: one that does not count the short gaps between kernels);
 * STUB_NVML_DELAY_US: each such call takes that long (NVML under contention).
 */
#define _GNU_SOURCE
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include "stub_state.h"

#define API __attribute__((visibility("default")))
typedef int nvmlReturn_t;
typedef struct { unsigned long long total, free, used; } nvmlMemory_t;
typedef struct { unsigned version; unsigned long long total, reserved, free, used; } nvmlMemory_v2_t;
typedef struct { unsigned pid; unsigned long long usedGpuMemory; unsigned gi, ci; } nvmlProcessInfo_t;
typedef struct { unsigned gpu, memory; } nvmlUtilization_t;
#define MIB (1024ull * 1024ull)

static int inited;
static int ndev(void) { long n = stub_env("STUB_NDEV", 1); return n < 1 ? 1 : n > STUB_MAXDEV ? STUB_MAXDEV : (int)n; }
static unsigned long long total(void) { return (unsigned long long)stub_env("STUB_MEM_MIB", 1024) * MIB; }
static int idx(void *h) { int i = (int)((uintptr_t)h - 0x100); return i >= 0 && i < ndev() ? i : -1; }

API nvmlReturn_t nvmlInit_v2(void) { inited++; return 0; }
API nvmlReturn_t nvmlInit(void) { return nvmlInit_v2(); }
API nvmlReturn_t nvmlInitWithFlags(unsigned f) { (void)f; return nvmlInit_v2(); }
API nvmlReturn_t nvmlShutdown(void) { if (inited) inited--; return 0; }
API nvmlReturn_t nvmlDeviceGetCount_v2(unsigned *n) { if (!inited) return 1; *n = (unsigned)ndev(); return 0; }
API nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned i, void **h) { if (!inited) return 1; if ((int)i >= ndev() || !h) return 2; *h = (void *)(uintptr_t)(0x100 + i); return 0; }
API nvmlReturn_t nvmlDeviceGetIndex(void *h, unsigned *i) { int d = idx(h); if (d < 0 || !i) return 2; *i = (unsigned)d; return 0; }
API nvmlReturn_t nvmlDeviceGetUUID(void *h, char *buf, unsigned len)
{
    int d = idx(h);
    unsigned char b[16];
    if (d < 0 || !buf) return 2;
    stub_uuid_bytes(d, b);
    snprintf(buf, len, "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", b[0], b[1], b[2],
             b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12], b[13], b[14], b[15]);
    return 0;
}
API nvmlReturn_t nvmlDeviceGetHandleByUUID(const char *uuid, void **h)
{
    if (!inited) return 1;
    for (int i = 0; i < ndev(); i++) {
        char u[96];
        nvmlDeviceGetUUID((void *)(uintptr_t)(0x100 + i), u, sizeof u);
        if (!strcmp(u, uuid)) { *h = (void *)(uintptr_t)(0x100 + i); return 0; }
    }
    return 6; /* NOT_FOUND */
}

static unsigned long long used_all(int d)
{
    struct stub_state *s = stub_state();
    unsigned long long u = 0;
    for (int i = 0; i < STUB_MAXPROC; i++) {
        int32_t pid = atomic_load(&s->proc[i].pid);
        if (pid && kill(pid, 0) == 0)
            u += atomic_load(&s->proc[i].used[d]);
    }
    return u;
}
API nvmlReturn_t nvmlDeviceGetMemoryInfo(void *h, nvmlMemory_t *m)
{
    int d = idx(h);
    if (!inited) return 1;
    if (d < 0 || !m) return 2;
    m->total = total(), m->used = used_all(d), m->free = m->total - m->used;
    return 0;
}
API nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(void *h, nvmlMemory_v2_t *m)
{
    int d = idx(h);
    if (!inited) return 1;
    if (d < 0 || !m) return 2;
    m->total = total(), m->reserved = 5 * MIB, m->used = used_all(d), m->free = m->total - m->used - m->reserved;
    return 0;
}
API nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(void *h, unsigned *n, nvmlProcessInfo_t *out)
{
    int d = idx(h);
    if (!inited) return 1;
    if (d < 0 || !n) return 2;
    struct stub_state *s = stub_state();
    unsigned k = 0;
    /* other processes listed first (STUB_NVML_FAKE_PROCS of them, 2 MiB each): a card shared by
     * more processes than a fixed buffer holds */
    for (long i = 0, fake = stub_env("STUB_NVML_FAKE_PROCS", 0); i < fake; i++, k++)
        if (k < *n && out)
            out[k] = (nvmlProcessInfo_t){(unsigned)(4000000 + i), 2 * MIB, 0, 0};
    for (int i = 0; i < STUB_MAXPROC; i++) {
        int32_t pid = atomic_load(&s->proc[i].pid);
        unsigned long long u = atomic_load(&s->proc[i].used[d]);
        if (!pid || !u || kill(pid, 0) != 0)
            continue;
        if (k < *n && out)
            out[k] = (nvmlProcessInfo_t){(unsigned)pid, u, 0, 0};
        k++;
    }
    int short_buf = k > *n;
    *n = k;
    return short_buf ? 7 : 0;
}
typedef struct { unsigned long long timeStamp; unsigned long long value; } nvmlSample_t;
API nvmlReturn_t nvmlDeviceGetSamples(void *h, int type, unsigned long long last, int *vtype, unsigned *n,
                                      nvmlSample_t *out)
{
    static uint64_t prev_t, prev_busy;
    int d = idx(h);
    if (!inited) return 1;
    if (d < 0 || !n || !vtype || type != 1) return 2;
    long delay = stub_env("STUB_NVML_DELAY_US", 0);
    if (delay > 0)
        usleep((useconds_t)delay);
    struct stub_state *s = stub_state();
    uint64_t now = stub_now(), busy = 0, R = s->ps[d].R;
    int ts = stub_env("STUB_TIMESLICE", 0) != 0;
    for (int i = 0; i < STUB_MAXPROC; i++) { /* time-sliced: the work the card's clock has run */
        uint64_t b = atomic_load(&s->proc[i].busy_ns[d]), e = atomic_load(&s->proc[i].busy_until[d]);
        uint64_t left = ts && e > R ? e - R : 0;
        busy += b > left ? b - left : 0;
    }
    struct timespec rt; /* NVML stamps samples with the wall clock */
    clock_gettime(CLOCK_REALTIME, &rt);
    uint64_t us = (uint64_t)rt.tv_sec * 1000000u + (uint64_t)rt.tv_nsec / 1000u;
    if (us <= last) return 6; /* NVML_ERROR_NOT_FOUND: nothing newer */
    if (!out || !*n) { *n = 1; return out ? 7 : 0; }
    uint64_t el = prev_t && now > prev_t ? now - prev_t : 0;
    uint64_t pct = el ? (busy - prev_busy) * (uint64_t)stub_env("STUB_NVML_BUSY_PM", 1000) / 10 / el : 0;
    *vtype = 1; /* NVML_VALUE_TYPE_UNSIGNED_INT */
    out[0].timeStamp = us;
    out[0].value = pct > 100 ? 100 : pct;
    *n = 1;
    prev_t = now, prev_busy = busy;
    return 0;
}
API nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v2(void *h, unsigned *n, nvmlProcessInfo_t *out)
{
    return nvmlDeviceGetComputeRunningProcesses_v3(h, n, out);
}
