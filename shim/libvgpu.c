/*
 * libvgpu.c - entry unit of the kvgpu shim (LD_PRELOAD / /etc/ld.so.preload).
 *
 * Owns the process state (`vgpu`), the one-time initialisation, logging, the fail-closed
 * rule and the exported version string. Initialisation is lazy and never calls CUDA: it reads
 * the claim (vgpu_config.c), opens the container's shared region (vgpu_region.c) and
 * registers the exit handler. A process that never touches CUDA or NVML (bash, ls) pays for
 * nothing but the mapping of this library.
 *
 * Fail closed: when a claim is present but cannot be parsed, every intercepted CUDA entry
 * point returns CUDA_ERROR_NOT_INITIALIZED and NVML initialisation returns
 * NVML_ERROR_UNINITIALIZED, after one message on stderr that names the bad field.
 */
#include "vgpu.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#ifndef VGPU_VERSION
#define VGPU_VERSION "0.1.0"
#endif

/* Embedded, exported version: `strings libvgpu.so | grep kvgpu-shim` or dlsym it. */
VGPU_API const char kvgpu_shim_version[] = "kvgpu-shim " VGPU_VERSION;

struct vgpu_state vgpu;
static pthread_once_t init_once = PTHREAD_ONCE_INIT;

void vgpu_log(int level, const char *fmt, ...)
{
    if (level > vgpu.cfg.log_level)
        return;
    char buf[512];
    va_list ap;
    va_start(ap, fmt);
    int n = snprintf(buf, sizeof buf, "kvgpu-shim[%d]: %s", (int)getpid(),
                     level == 0 ? "error: " : level == 1 ? "warning: " : "");
    if (n > 0 && (size_t)n < sizeof buf)
        vsnprintf(buf + n, sizeof buf - (size_t)n, fmt, ap);
    va_end(ap);
    size_t len = strnlen(buf, sizeof buf - 2);
    buf[len++] = '\n';
    ssize_t w = write(2, buf, len); /* one write: lines of concurrent processes stay whole */
    (void)w;
}

static const char *env_get(const char *name, void *ctx)
{
    (void)ctx;
    /* Not an env var: whether the kvgpu claims volume is mounted (a file-system fact the
     * container's own processes cannot unset). */
    if (strcmp(name, VGPU_CLAIM_MOUNT_KEY) == 0)
        return access(VGPU_CLAIM_MOUNT, F_OK) == 0 ? VGPU_CLAIM_MOUNT : NULL;
    if (strcmp(name, VGPU_CONTAINER_CLAIM_KEY) == 0)
        return access(VGPU_CONTAINER_CLAIM, F_OK) == 0 ? VGPU_CONTAINER_CLAIM : NULL;
    if (strcmp(name, VGPU_CONTAINER_REGION_KEY) == 0)
        return VGPU_CONTAINER_REGION_DIR;
    if (strcmp(name, VGPU_CONTAINER_SCHED_KEY) == 0)
        return access(VGPU_CONTAINER_SCHED_DIR, F_OK) == 0 ? VGPU_CONTAINER_SCHED_DIR : NULL;
    return getenv(name);
}

static void at_exit(void)
{
    /* registered with atexit and run by the destructor too: whichever comes first */
    static atomic_int done;
    if (atomic_exchange(&done, 1))
        return;
#ifdef VGPU_STATS
    const uint64_t *st = vgpu.st_start;
    if (st[VGPU_ST_INIT]) /* us: the shim's init, the driver's cuInit, the device map, NVML, slot, charge, context */
        fprintf(stderr, "vgpu-stats-start pid=%d init_us=%llu cuinit_us=%llu map_us=%llu nvml_init_us=%llu "
                "nvml_procs_us=%llu slot_us=%llu charge_us=%llu ctx_driver_us=%llu\n", (int)getpid(),
                (unsigned long long)(st[VGPU_ST_INIT] / 1000), (unsigned long long)(st[VGPU_ST_CUINIT] / 1000),
                (unsigned long long)(st[VGPU_ST_MAP] / 1000), (unsigned long long)(st[VGPU_ST_NVML_INIT] / 1000),
                (unsigned long long)(st[VGPU_ST_NVML_PROCS] / 1000), (unsigned long long)(st[VGPU_ST_SLOT] / 1000),
                (unsigned long long)(st[VGPU_ST_CHARGE] / 1000), (unsigned long long)(st[VGPU_ST_CTX_DRIVER] / 1000));
    for (int d = 0; d < vgpu.cfg.ndev; d++) {
        struct vgpu_gate *g = &vgpu.gate[d];
        for (int m = 1; m < 6 && g->active; m++)
            fprintf(stderr, "vgpu-stats pid=%d dev=%d mode=%d batches=%llu launches=%llu span_us=%llu "
                    "charged_us=%llu prov_us=%llu est_ns=%llu kern_ns=%llu gap_pm=%u cal_pm=%u cal_raw_pm=%llu throttles=%llu\n",
                    (int)getpid(), d, m, (unsigned long long)g->st_n[m], (unsigned long long)g->st_launches[m],
                    (unsigned long long)(g->st_span[m] / 1000), (unsigned long long)(g->st_charged[m] / 1000),
                    (unsigned long long)(g->st_prov[m] / 1000), (unsigned long long)g->est_ns,
                    (unsigned long long)g->kern_ns, g->gap_pm, g->cal_pm,
                    (unsigned long long)(g->cal_own_busy ? g->cal_card_busy * 1000 / g->cal_own_busy : 0),
                    (unsigned long long)g->throttles);
        if (g->active)
            fprintf(stderr, "vgpu-stats-track pid=%d dev=%d span_us=%llu cpu_in_gaps_us=%llu cal_max_pm=%u "
                    "twice_us=%llu\n", (int)getpid(), d, (unsigned long long)(g->st_tspan / 1000),
                    (unsigned long long)(g->st_tcpu / 1000), vgpu_gate_cal_raise(g),
                    (unsigned long long)(g->st_twice / 1000));
        for (int k = 1, last = 0; g->active && g->len_ns && k < 64; k++) { /* V's advance x len/P */
            if (!g->st_sec_vt[k])
                continue; /* no slow path in that second */
            fprintf(stderr, "vgpu-sec pid=%d dev=%d s=%d wait_ms=%.1f charged_ms=%.1f over_s=%d\n", (int)getpid(), d,
                    k, g->st_sec_wait[k] / 1e6,
                    g->st_sec_vt[last] ? (double)(g->st_sec_vt[k] - g->st_sec_vt[last]) * g->len_ns / g->period_ns / 1e6 : 0,
                    k - last);
            last = k;
        }
        uint64_t n = g->st_trace_n, i = n > VGPU_TRACE_LEN ? n - VGPU_TRACE_LEN : 0;
        for (; g->active && i < n; i++) { /* times: us into the period (window: offset, len) */
            const struct vgpu_trace_ent *e = &g->st_trace[i % VGPU_TRACE_LEN];
            uint64_t P = g->period_ns;
            fprintf(stderr, "vgpu-trace pid=%d dev=%d win=%llu+%llu t=%llu.%06llu ret=%lld queued=%llu est=%llu "
                    "credit=%lld open=%lld\n", (int)getpid(), d, (unsigned long long)(g->offset_ns / 1000),
                    (unsigned long long)(g->len_ns / 1000), (unsigned long long)(e->now / P),
                    (unsigned long long)(e->now % P / 1000), e->ret ? (long long)(e->ret - e->now) / 1000 : 0LL,
                    (unsigned long long)(e->queued / 1000), (unsigned long long)(e->est / 1000),
                    (long long)(e->credit / 1000),
                    e->open_until ? (long long)(e->open_until - e->now) / 1000 : 0LL);
        }
    }
#endif
    if (vgpu.region.r)
        vgpu_region_leave(&vgpu.region);
}

/* fork (PyTorch DataLoader workers, subprocess from a threaded program): no lock of the shim
 * may be held by another thread at the moment of fork, or the child, which has only the forking
 * thread, would wait for it forever. So prepare takes them all (vgpu_cuda.c: the lock order),
 * the parent gives them back, and the child re-initialises them. The child is a new process:
 * it takes its own slot on first use and owns none of the parent's allocations (CUDA contexts
 * do not survive fork). The region's process-shared lock is not taken: its holder, if any, is a
 * thread that goes on running (in the parent) or a process the robust mutex recovers from. */
static void fork_prepare(void)
{
    vgpu_cuda_fork_prepare();
}

static void fork_parent(void)
{
    vgpu_cuda_fork_parent();
}

static void fork_child(void)
{
    vgpu.region.slot = -1;
    vgpu_cuda_fork_child();
}

/* mode=mps: make this process the MPS client its claim says, whatever its environment says
 * (any process can set its own env; the claim file is the trusted input): the card's pipe
 * directory (container mode: the device plugin's mount), the SM share as the active thread
 * percentage, and the claim's memory as the pinned device memory limit (the driver's second
 * wall behind the shim's). Set before the driver reads them at cuInit (the first hook runs this).
 * No control daemon behind the pipe would make CUDA run without MPS, i.e. without an SM limit:
 * fail closed instead. */
static int mps_client_setup(void)
{
    char buf[64 * VGPU_MAX_DEV], *p = buf;
    const char *dir = vgpu.cfg.container ? VGPU_CONTAINER_MPS_DIR : getenv("CUDA_MPS_PIPE_DIRECTORY");
    if (!dir || !dir[0])
        dir = "/tmp/nvidia-mps"; /* the driver's default */
    if (vgpu.cfg.container)
        setenv("CUDA_MPS_PIPE_DIRECTORY", dir, 1);
    char ctl[600];
    snprintf(ctl, sizeof ctl, "%s/control", dir);
    if (access(ctl, F_OK) != 0) {
        snprintf(vgpu.cfg.error, sizeof vgpu.cfg.error,
                 "the claim is for an MPS card but no MPS control daemon listens in %.150s", dir);
        return -1;
    }
    int cores = vgpu.cfg.dev[0].cores;
    snprintf(buf, sizeof buf, "%d", cores > 0 && cores < 100 ? cores : 100);
    setenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", buf, 1);
    buf[0] = 0;
    for (int d = 0; d < vgpu.cfg.ndev; d++)
        p += snprintf(p, sizeof buf - (size_t)(p - buf), "%s%d=%lluM", d ? "," : "", d,
                      (unsigned long long)(vgpu.cfg.dev[d].mem_limit / VGPU_MIB));
    setenv("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", buf, 1);
    for (int d = 0; d < vgpu.cfg.ndev; d++)
        vgpu.cfg.dev[d].cores = 0; /* the driver partitions the SMs: no compute gate (region too) */
    return 0;
}

static void do_init(void)
{
    vgpu_config_load(&vgpu.cfg, env_get, NULL);
    for (int i = 0; i < VGPU_MAX_DEV; i++)
        vgpu.cuda_map[i] = -1;
    if (vgpu.cfg.disabled)
        return;
    if (vgpu.cfg.broken) {
        vgpu_log(0, "refusing to initialise CUDA: invalid GPU claim (%s). Fix the claim "
                    "(KVGPU_CLAIM / KVGPU_CLAIM_FILE / CUDA_DEVICE_*_LIMIT) or ask the "
                    "cluster admin; running unlimited is not allowed.", vgpu.cfg.error);
        return;
    }
    if (vgpu.cfg.env_ignored)
        vgpu_log(1, "ignoring %s%s%sset in this process: the container's claim file %s is the "
                    "only claim (claim %s)",
                 vgpu.cfg.env_ignored & 1 ? "KVGPU_CLAIM " : "",
                 vgpu.cfg.env_ignored & 2 ? "KVGPU_CLAIM_FILE " : "",
                 vgpu.cfg.env_ignored & 4 ? "KVGPU_REGION_DIR " : "", VGPU_CONTAINER_CLAIM,
                 vgpu.cfg.claim);
    if (vgpu.cfg.source == VGPU_SRC_NONE)
        return;
    if (vgpu.cfg.mps && mps_client_setup() != 0) {
        vgpu.cfg.broken = 1;
        vgpu_log(0, "refusing to initialise CUDA: %s", vgpu.cfg.error);
        return;
    }
    if (vgpu_region_open(&vgpu.region, vgpu.cfg.region_path, &vgpu.cfg) != 0) {
        /* Without the shared region each process would get the whole quota: fail closed.
         * EPERM: the region was created for another claim (its first claim fixes the limits). */
        vgpu.cfg.broken = 1;
        if (errno == EPERM)
            snprintf(vgpu.cfg.error, sizeof vgpu.cfg.error,
                     "the shared region %.120s belongs to another claim; this process presents "
                     "claim '%.40s' with other limits", vgpu.cfg.region_path,
                     vgpu.cfg.claim[0] ? vgpu.cfg.claim : "(HAMi env)");
        else
            snprintf(vgpu.cfg.error, sizeof vgpu.cfg.error, "cannot open the shared region %.200s: %m",
                     vgpu.cfg.region_path);
        vgpu_log(0, "refusing to initialise CUDA: %s", vgpu.cfg.error);
        return;
    }
    vgpu.limited = 1;
    /* A gate on some card; an uncapped high-priority tenant of a coordinated node is measured
     * (vgpu_compute_setup), so that the agent gives low priority what it leaves. */
    for (int d = 0; d < vgpu.cfg.ndev; d++)
        if (vgpu.cfg.policy != VGPU_POLICY_DISABLE &&
            (vgpu.cfg.dev[d].cores > 0 || (vgpu.cfg.priority == 0 && vgpu.cfg.sched_dir[0] && vgpu.cfg.claim[0])))
            vgpu.compute_limited = 1;
    atexit(at_exit);
    pthread_atfork(fork_prepare, fork_parent, fork_child);
    vgpu_log(2, "claim %s: %d device(s), region %s", vgpu.cfg.claim[0] ? vgpu.cfg.claim : "(HAMi env)",
             vgpu.cfg.ndev, vgpu.cfg.region_path);
}

static void do_init_timed(void)
{
    VGPU_ST_T0(t0);
    do_init();
    VGPU_ST_ADD(VGPU_ST_INIT, t0);
}

void vgpu_init(void)
{
    pthread_once(&init_once, do_init_timed);
}

int vgpu_cuda_ready(void)
{
    vgpu_init();
    return vgpu.cfg.broken ? CUDA_ERROR_NOT_INITIALIZED : CUDA_SUCCESS;
}

__attribute__((destructor)) static void vgpu_fini(void)
{
    at_exit();
}
