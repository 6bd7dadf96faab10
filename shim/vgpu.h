/*
 * vgpu.h - internal contract between the units of the kvgpu shim (libvgpu.so).
 *
 * Units (all names prefixed vgpu_):
 *   vgpu_config.c   claim string (KVGPU_CLAIM v1) and HAMi-core env parsing      [pure]
 *   vgpu_region.c   shared per-container region: slots, robust lock, quota      [pure + POSIX]
 *   vgpu_compute.c  compute limiter: credit on measured GPU time                [pure]
 *   vgpu_sched.c    the node agent's compute schedule file and window layout    [pure + POSIX]
 *   vgpu_symbols.c  real libcuda/libnvidia-ml binding, dlsym, cuGetProcAddress
 *   vgpu_cuda.c     CUDA driver hooks: device map, cuInit, the CUDA hook table (vgpu_cuda.h)
 *   vgpu_hooks.h    the hook list (X-macros): indices, prototypes, accessors, the tables' entries
 *   vgpu_cuda_mem.c CUDA memory hooks: memory info, linear/async/VMM allocations (vgpu_mem.h)
 *   vgpu_mem_*.c    the other memory units: arrays, graph memory, contexts, the allocation table
 *   vgpu_nvml.c     NVML view (memory info v1/v2) and per-process usage
 *   libvgpu.c       entry unit: init, fail-closed gate, logging, version
 *
 * Units marked [pure] are also compiled into the cffi test module (shim/_build/_vgpucore*.so);
 * they never call CUDA or NVML. No CUDA or NVML header is needed: the few types used are
 * declared in vgpu_types.h with the layouts of the CUDA driver API reference (cuda.h, CUDA
 * 12/13) and nvml.h.
 *
 * Units: memory in bytes inside the shim (MiB only at the claim/env boundary), compute in
 * percent of the card's SMs, time in nanoseconds of CLOCK_MONOTONIC.
 */
#ifndef VGPU_H
#define VGPU_H

#include <stddef.h>
#include <stdint.h>
#include <stdatomic.h>
#include <pthread.h>
#include <sys/types.h>

#define VGPU_API __attribute__((visibility("default")))
#define VGPU_MAX_DEV 16
#define VGPU_UUID_LEN 96
#define VGPU_CLAIM_LEN 320
#define VGPU_MIB (1024ull * 1024ull)
#define VGPU_MS (1000000ull)        /* nanoseconds */
#define VGPU_SEC (1000000000ull)

/* Timing of the shim (ns of CLOCK_MONOTONIC). */
#define VGPU_DEFAULT_PERIOD_NS (100 * VGPU_MS)  /* compute period without KVGPU_COMPUTE_PERIOD_MS */
/* A tenant alone banks at most this much GPU time while idle: spent on top of its share in the
 * next second, so that second holds at most 2.5 points more (a share x period bucket held 7 at
 * 70 %). Beside co-tenants the bucket is a window's worth (its room is granted as credit). */
#define VGPU_BUCKET_MAX_NS (25 * VGPU_MS)
#ifndef VGPU_COTENANT_FRAME_MUL /* -D for a same-call comparison (bench/gpu/limiter_ab.sh) */
/* Beside co-tenants the windows repeat every this many periods (the frame). Each hand-over
 * between two tenants leaves the card idle for about a kernel (the last launch must end inside
 * the window, the next tenant wakes at its window's start): a longer frame has fewer of them. */
#define VGPU_COTENANT_FRAME_MUL 2u
#endif
#ifndef VGPU_BURST_MAX_BUSY_PM /* -D for a same-call comparison (bench/gpu/limiter_ab.sh) */
/* A co-tenant starts a burst outside its window only while its measured busy share is under this
 * per mille of its window's share (a tenant that wants about its share keeps to its window). */
#define VGPU_BURST_MAX_BUSY_PM 750u
#endif
#define VGPU_SCHED_REFRESH_NS (100 * VGPU_MS)   /* schedule read, heartbeat and busy share */
#define VGPU_GATE_MAX_SLEEP_NS (100 * VGPU_MS)  /* a waiting launch re-decides at least this often */
#define VGPU_NO_WINDOW_WAIT_NS (100 * VGPU_MS)  /* a schedule leaving no time: wait, then look again */
#define VGPU_TRACE_LEN 2048                     /* VGPU_STATS builds: slow-path decisions kept */
#define VGPU_BUSY_RISE_MIN_NS (20 * VGPU_MS)    /* a rising busy share is published once measured this long */
#define VGPU_RECONCILE_NS (200 * VGPU_MS)       /* NVML reconciliation on allocation paths */
#define VGPU_RECONCILE_NEAR_NS (10 * VGPU_MS)   /* ... within 10 % of the limit */
#define VGPU_RECONCILE_REFUSE_NS (2 * VGPU_MS)  /* ... before a refusal (a container racing its
                                                 * limit must not hold its newcomers in a convoy) */
#define VGPU_MODULE_RECONCILE (64ull << 20) /* module loads' drops summed past this: reconciled */
#define VGPU_REAP_REFUSE_NS (50 * VGPU_MS)      /* dead processes' quota looked for before a refusal */
#define VGPU_REAP_NS (1 * VGPU_SEC)             /* dead processes' slots reaped at most this often */
#define VGPU_OOM_GRACE_NS (100 * VGPU_MS)       /* ACTIVE_OOM_KILLER: a victim's time to go */
#define VGPU_OOM_POLL_US 2000                   /* ... polled this often (us) */

/* Fields one thread writes under a lock and others peek at without it (a hint re-checked under
 * the lock): relaxed atomic accesses, plain loads and stores on x86, clean under TSan. */
#define VGPU_PEEK(x) __atomic_load_n(&(x), __ATOMIC_RELAXED)
#define VGPU_POKE(x, v) __atomic_store_n(&(x), (v), __ATOMIC_RELAXED)

/* ------------------------------------------------------------------ locks and cancellation */

/* The shim holds its locks across cancellation points (the gate's sleep, a driver or NVML call):
 * a thread cancelled there (pthread_cancel) would end with the lock held, and every other thread
 * of the process (of the container, for the region's lock: a robust mutex, whose next holder
 * would then repair a half-done update) would wait or recount. Cancellation is held off from a
 * lock to its release, nested; a request that comes meanwhile acts at the thread's next
 * cancellation point after the last release. Defined in vgpu_region.c. */
extern __thread int vgpu_nocancel_depth;
extern __thread int vgpu_nocancel_saved;
static inline void vgpu_nocancel_enter(void)
{
    if (vgpu_nocancel_depth++ == 0)
        pthread_setcancelstate(PTHREAD_CANCEL_DISABLE, &vgpu_nocancel_saved);
}
static inline void vgpu_nocancel_leave(void)
{
    if (vgpu_nocancel_depth > 0 && --vgpu_nocancel_depth == 0)
        pthread_setcancelstate(vgpu_nocancel_saved, NULL);
}
static inline void vgpu_lock(pthread_mutex_t *m)
{
    vgpu_nocancel_enter();
    pthread_mutex_lock(m);
}
static inline void vgpu_unlock(pthread_mutex_t *m)
{
    pthread_mutex_unlock(m);
    vgpu_nocancel_leave();
}

/* ------------------------------------------------------------------ config (pure) */

enum vgpu_source { VGPU_SRC_NONE = 0, VGPU_SRC_CLAIM = 1, VGPU_SRC_HAMI = 2 };
enum vgpu_policy { VGPU_POLICY_DEFAULT = 0, VGPU_POLICY_FORCE = 1, VGPU_POLICY_DISABLE = 2 };

struct vgpu_dev_cfg {
    char uuid[VGPU_UUID_LEN]; /* "GPU-..." / "MIG-..."; empty in HAMi index mode */
    uint64_t mem_limit;       /* bytes; 0 = no memory limit */
    int cores;                /* percent of SMs, 0 = no compute limit, 100 = whole card */
};

struct vgpu_config {
    int source;               /* enum vgpu_source */
    int broken;               /* 1: a claim is present but invalid -> fail closed */
    char error[256];          /* why it is broken (names the field) */
    char claim[VGPU_CLAIM_LEN];
    int priority;             /* 0 high, 1 low */
    int ndev;
    struct vgpu_dev_cfg dev[VGPU_MAX_DEV];
    int policy;               /* enum vgpu_policy (GPU_CORE_UTILIZATION_POLICY) */
    int log_level;            /* 0 errors, 1 +warnings (default), 2 +info, 3+ debug */
    int disabled;             /* CUDA_DISABLE_CONTROL=true: shim passes everything through */
    int oom_killer;           /* ACTIVE_OOM_KILLER=true|1|yes: end the process over the limit */
    char region_path[512];    /* file of the shared region, "" = process-private */
    char sched_dir[512];      /* KVGPU_SCHED_DIR: node-wide compute schedule, "" = none */
    uint64_t period_ns;       /* compute window period (KVGPU_COMPUTE_PERIOD_MS, default 100 ms) */
    int container;            /* 1: the claim came from the container's claim file (authoritative) */
    int env_ignored;          /* container mode: a process-set KVGPU_CLAIM (1), KVGPU_CLAIM_FILE (2)
                               * or region dir (4) differs from the container's and was ignored */
    int mps;                  /* claim mode=mps: an MPS client (the driver partitions the SMs) */
};

/* Parse a KVGPU_CLAIM v1 string (grammar: operator/kvgpu/core/claimstr.py). 0 on success,
 * -1 with cfg->error set. Fills cfg->claim, priority, ndev, dev[] only. */
int vgpu_claim_parse(const char *text, struct vgpu_config *cfg);
/* Parse a HAMi-core memory quantity ("3000m", "3g", "1024k", "3145728000"); bytes in *out.
 * 0 on success, -1 if malformed. */
int vgpu_parse_mem(const char *text, uint64_t *out);
/* Build the whole config from an environment lookup function (getenv in the shim; a dict in
 * tests) and an optional file reader. Never fails: problems set cfg->broken. */
typedef const char *(*vgpu_getenv_fn)(const char *name, void *ctx);
void vgpu_config_load(struct vgpu_config *cfg, vgpu_getenv_fn get, void *ctx);
/* The admission webhook mounts the claims volume here in every container with slices. The
 * loader asks the getter for VGPU_CLAIM_MOUNT_KEY: the real shim answers from the file system
 * (not from the environment), the test module from its env block. */
#define VGPU_CLAIM_MOUNT "/etc/kvgpu"
#define VGPU_CLAIM_MOUNT_KEY "@kvgpu-claim-mount"
/* The container's own claim, read-only, one file per container (keys.CONTAINER_CLAIM_FILE).
 * When it exists it is the only source of the claim: KVGPU_CLAIM, KVGPU_CLAIM_FILE, HAMi's
 * variables and the region/schedule directory variables are ignored (a process of the
 * container can set those; it cannot change this file). The getter answers the key with the
 * path when the file exists (real shim: the file system), NULL otherwise. */
#define VGPU_CONTAINER_CLAIM VGPU_CLAIM_MOUNT "/claim"
#define VGPU_CONTAINER_CLAIM_KEY "@kvgpu-container-claim"
/* In container mode the region and schedule directories are the webhook's fixed mounts. */
#define VGPU_CONTAINER_REGION_DIR "/var/run/kvgpu"
#define VGPU_CONTAINER_REGION_KEY "@kvgpu-container-region"
#define VGPU_CONTAINER_SCHED_DIR "/var/run/kvgpu-sched"
#define VGPU_CONTAINER_SCHED_KEY "@kvgpu-container-sched" /* the dir if it exists, else NULL */
/* mode=mps in container mode: the card's MPS pipe directory (the device plugin's mount). */
#define VGPU_CONTAINER_MPS_DIR "/var/run/kvgpu-mps"

/* ------------------------------------------------------------------ region (pure) */

#define VGPU_REGION_MAGIC 0x5247564bu /* "KVGR" little endian */
#define VGPU_REGION_VERSION 2u /* 2: sched_joined_ns, sched_heartbeat_ns */
#define VGPU_MAX_SLOTS 128

struct vgpu_region_dev {
    char uuid[VGPU_UUID_LEN];
    uint64_t limit;             /* bytes, 0 = none */
    uint32_t cores;             /* percent */
    uint32_t unused;            /* 0xffffffff; read and written by nobody (the container writes
                                 * this page, so nothing the agent reports may come from it) */
    _Atomic uint64_t used;      /* bytes charged = sum over live slots of data + overhead */
    _Atomic uint64_t credit_vt; /* compute: the container's credit clock V (CLOCK_MONOTONIC ns;
                                 * credit = now - V, see struct vgpu_gate) */
    _Atomic uint64_t ctx_bytes; /* what a context took on this card, learnt by the container's
                                 * first process: later ones charge it up front */
    /* compute activity, the container's only say in the node-wide schedule (read by the agent,
     * which lays out the windows from the claims; see vgpu_sched_read): */
    _Atomic uint64_t sched_joined_ns;    /* CLOCK_MONOTONIC when the gate became active (again) */
    _Atomic uint64_t sched_heartbeat_ns; /* last schedule refresh of the gate (every 100 ms) */
    _Atomic uint64_t sched_busy_pm;      /* GPU time the container's work took, per mille of wall
                                          * time (measured; a rise at once, a fall over ~1 s): what an uncapped
                                          * high-priority tenant leaves is 1000 minus this */
    uint64_t reserved[1];
};

struct vgpu_slot {
    int32_t pid;                /* PID in the container's namespace, 0 = free */
    int32_t host_pid;           /* written by the node agent when known, else 0 */
    uint64_t start_time;        /* /proc/<pid>/stat field 22 (clock ticks since boot) */
    uint64_t data[VGPU_MAX_DEV];     /* bytes of counted allocations */
    uint64_t overhead[VGPU_MAX_DEV]; /* bytes of context/module overhead charged */
    uint64_t pidns_dev;         /* the process's PID namespace: st_dev and st_ino of */
    uint64_t pidns_ino;         /* /proc/self/ns/pid (0, 0 = unknown: never reaped by /proc) */
    uint64_t dead_key;          /* the node agent's word: vgpu_slot_key(pid, start_time) when it
                                 * found no such process on the host (then reapable), else 0 */
    uint64_t reserved[1];
};

/* A process's PID namespace (st_dev, st_ino of its ns/pid link). */
struct vgpu_pidns { uint64_t dev, ino; };
/* The dead mark of a slot: (pid << 42) | (start_time mod 2^42), one aligned 64-bit word that
 * the agent stores without the lock. A slot taken again by another process in the meantime
 * carries another key, so a late mark never reaps it. */
#define VGPU_SLOT_KEY(pid, st) (((uint64_t)(uint32_t)(pid) << 42) | ((uint64_t)(st) & ((1ull << 42) - 1)))

struct vgpu_region {
    uint32_t magic;
    uint32_t version;
    uint32_t size;              /* sizeof(struct vgpu_region) */
    uint32_t ndev;
    uint32_t max_slots;
    uint32_t priority;
    uint64_t generation;        /* bumped on every (re)initialisation */
    char claim[VGPU_CLAIM_LEN];
    union { pthread_mutex_t m; char pad[64]; } lock; /* robust, process-shared */
    _Atomic uint64_t oom_kills; /* processes the shim's ACTIVE_OOM_KILLER ended (read by the agent) */
    int32_t oom_last_pid;       /* the last one: its container PID, card index and bytes charged */
    uint32_t oom_last_dev;
    uint64_t oom_last_bytes;
    uint64_t oom_last_used;     /* bytes charged to the container on that card at the kill */
    uint64_t reserved[4];
    struct vgpu_region_dev dev[VGPU_MAX_DEV];
    struct vgpu_slot slot[VGPU_MAX_SLOTS];
};

struct vgpu_region_handle {
    struct vgpu_region *r;
    int fd;
    int slot;                   /* own slot index or -1 */
    int private_map;            /* 1: anonymous mapping (no region file) */
    uint64_t reaped_ns;         /* last reap before a refusal (CLOCK_MONOTONIC; under the lock) */
};

/* Open (creating if needed) the region at path ("" = private). Limits come from cfg: the
 * first claim that opens a region fixes them; a cfg with another claim (name, priority,
 * devices, limits) is refused with errno EPERM. 0 on success, -1 with errno. */
int vgpu_region_open(struct vgpu_region_handle *h, const char *path, const struct vgpu_config *cfg);
/* Open an existing region read-only-ish for inspection (no slot). */
int vgpu_region_attach(struct vgpu_region_handle *h, const char *path);
void vgpu_region_close(struct vgpu_region_handle *h);
int vgpu_region_lock(struct vgpu_region *r);   /* 0; recovers a dead owner */
void vgpu_region_unlock(struct vgpu_region *r);
/* Take a slot for (pid, start_time) in this process's PID namespace (recorded in the slot; an
 * old slot of the same pid counts as its own only in the same namespace). Returns index or -1. */
int vgpu_region_join(struct vgpu_region_handle *h, int32_t pid, uint64_t start_time);
void vgpu_region_leave(struct vgpu_region_handle *h);
/* This process's PID namespace; {0, 0} when /proc/self/ns/pid cannot be read. */
struct vgpu_pidns vgpu_pidns_self(void);
/* Free slots whose process is gone. A slot of this process's PID namespace is checked in /proc
 * (pid gone or start time differs); a slot of another namespace (two pods or two containers
 * sharing one DRA claim region) or of an unknown one only when the node agent marked it dead
 * (dead_key). Lock held. Returns count. */
int vgpu_region_reap_locked(struct vgpu_region *r);
int vgpu_region_reap(struct vgpu_region *r); /* takes the lock */
/* Charge bytes on device d to own slot if it fits the limit. 0 ok, -1 over the limit. */
int vgpu_region_reserve(struct vgpu_region_handle *h, int d, uint64_t bytes);
void vgpu_region_release(struct vgpu_region_handle *h, int d, uint64_t bytes);
/* Set own overhead charge on device d (absolute, in full: no cap). Returns the bytes charged. */
uint64_t vgpu_region_set_overhead(struct vgpu_region_handle *h, int d, uint64_t bytes);
/* One process NVML lists on a card: its PID (as NVML numbers it) and the bytes it holds. */
struct vgpu_nvml_proc { uint32_t pid; uint64_t used; };
/* Each slot's counted bytes on device d (out: VGPU_MAX_SLOTS entries), read without the lock
 * (data[] is written with atomic stores). */
void vgpu_region_counted(const struct vgpu_region *r, int d, uint64_t *out);
/* Reconciliation of every process of the container on device d: each live slot that NVML lists
 * (procs, n entries) gets as overhead what NVML shows above its counted allocations (>= 0), so
 * memory an idle sibling holds past the hooks is charged when any process asks. A slot is found
 * by its host_pid when the node agent wrote it, else by its pid when it is this process's or,
 * in the host's PID namespace, shares it (self); a slot NVML does not list keeps its overhead.
 * before: each slot's counted bytes read before NVML was asked (vgpu_region_counted); the smaller
 * of that and the count now is taken, so an allocation or free racing the query can only
 * over-charge. A sibling's overhead is only raised (its own reconciliation may be newer than
 * this NVML answer), and only when its count did not move meanwhile; this process's is set. Takes the lock. Returns VGPU_RECON_OWN when this
 * process's slot was listed, | VGPU_RECON_MOVED when a listed slot's count moved meanwhile (the
 * figures may be over: reconcile again before acting on them). */
#define VGPU_RECON_OWN 1
#define VGPU_RECON_MOVED 2
int vgpu_region_reconcile(struct vgpu_region_handle *h, int d, const uint64_t *before,
                          const struct vgpu_nvml_proc *procs, unsigned n, struct vgpu_pidns self);
/* Move up to bytes of this process's counted charge on device d into its overhead, for memory
 * the driver may still hold (graph allocations past their executable graph): the next
 * reconciliation, by any process of the container, settles it from NVML. Takes the lock. */
void vgpu_region_to_overhead(struct vgpu_region_handle *h, int d, uint64_t bytes);
uint64_t vgpu_region_used(struct vgpu_region *r, int d);
/* The container is over its limit on d by more than `slack`: 1 with the live slot of this
 * process's PID namespace (the only PIDs it can signal) holding the most (data + overhead) on d in *pid, *start_time, *bytes; 0 otherwise. Takes the lock. */
int vgpu_region_oom_victim(struct vgpu_region *r, int d, uint64_t slack, int32_t *pid,
                           uint64_t *start_time, uint64_t *bytes);
/* Count a kill by the shim's OOM killer (oom_kills, oom_last_*). Takes the lock. */
void vgpu_region_oom_record(struct vgpu_region *r, int d, int32_t pid, uint64_t bytes);
/* Start time of a process from /proc/<pid>/stat (clock ticks), 0 if it does not exist. */
uint64_t vgpu_proc_start_time(int32_t pid);

/* ------------------------------------------------------------------ compute (pure) */

#define VGPU_SCHED_MAX 32
#define VGPU_SCHED_MAGIC 0x4853564bu /* "KVSH" */
#define VGPU_SCHED_VERSION 2u
#define VGPU_SCHED_STALE_NS (3ull * 1000000000ull) /* the agent drops an entry silent this long */
/* The node-wide schedule of one card, <sched dir>/<UUID>.sched: written only by the node agent
 * (operator/kvgpu/agent/schedule.py, atomically: temp file + rename, mode 0644), read-only to
 * tenants. A header, then `count` entries. */
struct vgpu_sched_hdr {
    uint32_t magic, version;
    uint32_t entry_size;        /* sizeof(struct vgpu_sched_window) */
    uint32_t count;             /* <= VGPU_SCHED_MAX */
};
struct vgpu_sched_window {
    char key[VGPU_CLAIM_LEN];   /* claim name "<namespace>/<name>", NUL-padded */
    uint32_t offset_pm;         /* window start, per mille of the period */
    uint32_t len_pm;            /* window length, per mille of the period */
};

/* Given the live entries, compute window offset and length (per mille of the period) for
 * entry `self`. High priority first, then by join time; shares are scaled down for low
 * priority when the sum exceeds 1000. Pure. (The agent's layout, operator/kvgpu/agent/
 * schedule.py, is the one in force; this twin stays for the tests that compare them.) */
void vgpu_sched_layout(const uint32_t *share_pm, const uint32_t *prio, const uint64_t *joined,
                       int n, int self, uint32_t *offset_pm, uint32_t *len_pm);

/* The compute limiter of one card in one process: work-conserving credit on the GPU time the
 * container's work really took. Credit is a clock V (container-wide, in the region): credit =
 * now - V, at most `burst_ns` (V >= now - burst). A launch passes while V <= now; each launch
 * advances V provisionally by its estimated cost (est_ns scaled by P / len, i.e. GPU ns at the
 * share's rate), and when the batch of launches it belonged to has run, V is corrected by the
 * measured GPU time (CUDA events around the batch). A tenant below its share therefore launches
 * at once; one above it waits until its credit is back; a long kernel leaves V far ahead of now
 * (debt) and the tenant waits in proportion. With co-tenants on the card (the agent's schedule
 * lists others), a tenant that has used up its burst runs only inside its own window of the
 * period, so saturating co-tenants take turns and do not stretch each other's batches. */
#define VGPU_BATCH_NS 5000000ull    /* a batch of launches is measured at least this often */
/* Kernels at least this long on average are measured one by one (an event before and after
 * each launch: a few us of CPU against >= 200 us of GPU). The application's own waits cannot be
 * relied on to end a batch: the CUDA runtime's cudaDeviceSynchronize reaches the driver through
 * its private export table, not through a hook (measured on the H200), so a batch of a long
 * kernel the application waited for would otherwise close at the next launch, idle time
 * included. */
#define LONG_KERNEL_NS 200000ull
#define VGPU_CAL_NS (500 * VGPU_MS)     /* busy calibration interval */
/* The reading after the one that only started NVML's sample cursor comes this long after it
 * (at most VGPU_CAL_NS). The first step then comes ~0.6 s into the work, and a container's
 * processes, which start far from their ratio, spent their first second at 22-24 % under 30 %
 * (H100). A shorter wait is an A/B not yet run on a GPU: its reading spans one or two samples. */
#ifndef VGPU_CAL_FIRST_NS /* -D for a same-call comparison (bench/gpu/limiter_ab.sh) */
#define VGPU_CAL_FIRST_NS VGPU_CAL_NS
#endif
#ifndef VGPU_CAL_MIN_WAIT_NS /* -D for a same-call comparison (bench/gpu/limiter_ab.sh) */
#define VGPU_CAL_MIN_WAIT_NS (2 * VGPU_MS) /* ... taken in a wait, once the waits since the last add up to this */
#endif
#define VGPU_CAL_POINT_NS (25 * VGPU_MS) /* measured-time series: a point at most this often */
#define VGPU_CAL_POINTS 128             /* ... kept (at least 3.2 s) */
#define VGPU_CAL_MIN_WORK_NS (20 * VGPU_MS) /* measured GPU time a span needs to count */
#ifndef VGPU_CAL_MIN_PM /* -D for a same-call comparison (bench/gpu/limiter_ab.sh) */
#define VGPU_CAL_MIN_PM 850u            /* the charge never falls below 85 % of the measured time */
#endif
#ifndef VGPU_CAL_MAX_PM
#define VGPU_CAL_MAX_PM 1150u           /* nor rises above 115 % of it, nor above the events' own
                                         * reading (vgpu_gate_cal_raise) */
#endif
/* A lone process whose launches average at least this long is not calibrated (vgpu_gate_calibrate):
 * a kernel settles when it ends, so a span of the card's samples holds a whole kernel more or
 * less than the process's own series, an error of est_ns against the share of a span (100 ms
 * kernels at 10 %: the ratio swung to 85 %). Under it the error is a few percent a span and the
 * decayed sums average it out. */
#ifndef VGPU_CAL_LONG_NS /* -D for a same-call comparison (bench/gpu/limiter_ab.sh) */
#define VGPU_CAL_LONG_NS (4 * VGPU_MS)
#endif
/* Processes of one container alone on the card (vgpu_gate_calibrate_container): the card's busy
 * time within this band of the share (per mille) moves nothing; otherwise the ratio moves part
 * of the way (GAIN) toward the card's reading, up as down (a faster rise than fall settles under
 * the share when the reading is noisy), all the way on the container's first step (the ratio
 * starts at 1: half the way, 2 processes spent their first 3 s at 0.86 of the share), a reading
 * taken as no lower than STEP (as built: at most 25 % down a step, 50 % on the first), and
 * never below VGPU_CAL_MIN_PM divided by the card's compute processes (at most
 * VGPU_CAL_CONT_PROCS): time-sliced beside n-1 siblings a span is at most n times the process's
 * own time. A reading above JUMP is no noise (siblings stopped): all the way up. */
#define VGPU_CAL_CONT_BAND_PM 30u
#ifndef VGPU_CAL_CONT_STEP_PM /* -D for a same-call comparison (bench/gpu/limiter_ab.sh) */
#define VGPU_CAL_CONT_STEP_PM 500u
#endif
#ifndef VGPU_CAL_CONT_GAIN_PM /* how far a step down goes toward the card's reading, per mille */
#define VGPU_CAL_CONT_GAIN_PM 500u
#endif
#ifndef VGPU_CAL_CONT_UP_GAIN_PM /* ... and a step up */
#define VGPU_CAL_CONT_UP_GAIN_PM 500u
#endif
#ifndef VGPU_CAL_CONT_JUMP_PM
#define VGPU_CAL_CONT_JUMP_PM 1500u
#endif
#ifndef VGPU_CAL_CONT_FIRST_PM /* the first step's gain, up as down */
#define VGPU_CAL_CONT_FIRST_PM 1000u
#endif
#define VGPU_CAL_CONT_PROCS 4u
#define VGPU_BATCH_RING 16          /* batches measured but not yet completed on the GPU */
#define VGPU_BATCH_OVERFLOW 32      /* given-up batches still awaited (vgpu_measure.c) */
#define VGPU_BATCH_STREAMS 4        /* streams one batch measures one by one */
/* The gate waits for the oldest batch's end, under its lock, in two places: a capped gate with
 * no estimate yet before its next launch passes, and a full ring to make room. It polls
 * cuEventQuery (sleeping 20 us, doubling to 1 ms) for at most this long, never in
 * cuEventSynchronize. The oldest batch is the work the GPU runs now: it ends within the kernels
 * queued ahead of it, so a 100 ms kernel behind a few others, even time-sliced beside a
 * co-tenant (twice its wall time), is measured well within a second. A batch still running
 * after a second most likely waits for something the application does next (a kernel waiting
 * for a value a later launch writes, a persistent kernel the thread stops later, a peer kernel
 * launched next on another card), which a wait would turn into a hang: it is given up (it keeps
 * its provisional charge) and the gate waits no more (vgpu_measure_poll), so this costs a second
 * once per card and process. */
#define VGPU_MEASURE_WAIT_NS (1 * VGPU_SEC)
/* A launch in a context another thread is destroying waits for the driver's return, in pauses
 * of VGPU_DYING_PAUSE_NS, at most VGPU_DYING_WAITS of them (then it runs unmeasured). */
#define VGPU_DYING_PAUSE_NS (50 * 1000ull)
#define VGPU_DYING_WAITS 2000
struct vgpu_batch {
    void *ev_open, *ev_close;   /* CUevent: recorded before its first and after its last launch */
    void *ctx;                  /* CUcontext its events belong to (the gate's when it was closed) */
    uint64_t launches;
    uint64_t prov_ns;           /* GPU ns charged provisionally (launches x estimate) */
    void *ev_probe;             /* CUevent right after the first launch: that kernel's own time */
    void *ev_seg;               /* gap-tracked: start of the batch's last busy segment (or NULL:
                                 * ev_open); the span from it to ev_close has no idle gap */
    uint64_t seg_busy_ns;       /* gap-tracked: GPU ns of the batch's earlier busy segments */
    uint64_t seg_ovh_ns;        /* gap-tracked: the event overhead taken off them (SEG_OVERHEAD_NS) */
    uint64_t track_gap_ns;      /* gap-tracked: the tracking's own CPU ns that delayed a launch
                                 * the GPU was idle for (idle time an untracked batch lacks) */
    int ntails;                 /* gap-tracked: its streams' tails (it ends at the latest) */
    void *tails[VGPU_BATCH_STREAMS];
    int tracked;                /* measured gap by gap (vgpu_launch.c): its GPU time is exact;
                                 * the tracked batches it stands for (vgpu_gate_tracked's weight) */
    int untracked;              /* its gap tracking stopped mid-batch (a launch into a capture,
                                 * a stream too many, an event that failed): charged its whole
                                 * span, never the gap ratio's share of it; the tracked batches
                                 * it stood for */
    /* Several streams: the batch's first stream is ev_open's and ev_close's; each other stream it
     * launched on (up to VGPU_BATCH_STREAMS in all; beyond, the batch is only a lower bound) has
     * its own pair, recorded before its first launch there and behind the batch. */
    void *stream;               /* the open batch's first stream */
    /* CU_STREAM_PER_THREAD names each thread's own stream: the thread (vgpu_thread_token) whose
     * per-thread stream the batch measures, 0 if it has none (peeked by the fast path) */
    uintptr_t pt_owner;
    int nxs;
    void *xs[VGPU_BATCH_STREAMS - 1], *xs_open[VGPU_BATCH_STREAMS - 1], *xs_close[VGPU_BATCH_STREAMS - 1];
};
#ifndef VGPU_TRACK_EVERY /* -D for a same-call comparison (bench/gpu/limiter_ab.sh) */
#define VGPU_TRACK_EVERY 2          /* one batch in this many (on average) is gap-tracked */
#endif
#ifndef VGPU_TRACK_UNDER_EVERY /* -D for a same-call comparison (bench/gpu/limiter_ab.sh) */
/* the same while the tenant is well under its share (vgpu_gate_track_every): there the charge's
 * precision decides nothing, and the tracking's CPU time slows a launch-bound loop. A multiple
 * of VGPU_TRACK_EVERY, at most 4 times it: a tracked batch of VGPU_GAP_SPAN_NS then moves the
 * ratio at most the whole way: batches of up to that span weigh in proportion to it, as at the
 * normal rate, and a longer one (a quarter of the way at the normal rate) sets it. */
#define VGPU_TRACK_UNDER_EVERY 8u
#endif
#ifndef VGPU_TRACK_UNDER_HEADROOM_PM
#define VGPU_TRACK_UNDER_HEADROOM_PM 100u
#endif
#define VGPU_GAP_SPAN_NS (5 * VGPU_MS) /* a tracked batch this long moves the gap ratio a quarter */
struct vgpu_gate {
    int active;                 /* 0 = no gate: launches pass untouched */
    int measure_only;           /* 1 = uncapped high priority: measure and publish, never wait */
    int cotenants;              /* the schedule lists other tenants of this card */
    int sched_listed;           /* the agent's schedule lists this container (cotenants says
                                 * whether others too) */
    int bursting;               /* co-tenants: spending a full bucket outside the window */
    uint64_t burst_v0;          /* co-tenants: V when the burst began (it ends a bucket later) */
    uint64_t waited_ns;         /* co-tenants: when a launch last had to wait (no burst for 2 frames) */
    uint64_t base_period_ns;    /* KVGPU_COMPUTE_PERIOD_MS: the bucket of a tenant alone */
    uint64_t period_ns;         /* the frame: base period, x VGPU_COTENANT_FRAME_MUL beside co-tenants */
    uint64_t share_ns;          /* own share (the claim's cores) x base period */
    uint64_t offset_ns;         /* own window inside the frame (schedule) */
    uint64_t len_ns;            /* own window length = the credit rate x period; 0 = no time */
    uint64_t burst_ns;          /* bucket depth (credit clock ns) */
    uint64_t batch_ns;          /* batch length (>= VGPU_BATCH_NS, >= 2 x coarse clock margin) */
    uint64_t est_ns;            /* GPU ns per launch (EWMA of measured batches); 0 = unknown */
    _Atomic uint64_t vt_cost;   /* credit clock ns per launch = est_ns x P / len */
    _Atomic uint64_t *vt;       /* the credit clock V (region: container-wide) */
    _Atomic uint64_t local_vt;
    _Atomic uint64_t open_until; /* the fast path may pass before this time (0 = slow path) */
    _Atomic uint64_t batch_n;   /* launches in the open batch */
    _Atomic int inflight;       /* launches counted that have not returned from the driver yet
                                 * (a close waits for them: vgpu_measure_close) */
    int multi_stream;           /* a stream of the open batch has no events: a lower bound */
    struct vgpu_batch cur;      /* the open batch (cur.ev_open NULL: none) */
    struct vgpu_batch ring[VGPU_BATCH_RING];
    unsigned ring_head, ring_len;
    struct vgpu_batch over[VGPU_BATCH_OVERFLOW]; /* given up while running, still awaited */
    int nover;
    uint64_t forfeits;          /* batches pushed out of a full overflow (vgpu_gate_forfeit) */
    void *pool[(4 + 2 * (VGPU_BATCH_STREAMS - 1)) * VGPU_BATCH_RING + 4];
    int npool;
    int wait_gave_up;           /* a wait for a batch ran out: the gate never waits for one again */
    void *ev_ctx;               /* CUcontext of the open batch and the pooled events: the one of
                                 * the last slow-path launch (peeked by the fast path) */
    /* GPU time charged already (vgpu_measure.c, "time charged twice"): from event cov_open to
     * cov_close, both of ev_ctx (NULL: none), at cov_pm per mille of the time between them */
    void *cov_open, *cov_close;
    uint32_t cov_pm;
    void *ctx_dying;            /* CUcontext being destroyed (between the release of its events
                                 * and the driver's return): no event is made in it meanwhile */
    uint64_t busy_acc_ns, busy_since_ns; /* measured GPU time since busy_since (publication) */
    uint32_t busy_pm;           /* smoothed per mille of wall time */
    pthread_mutex_t mu;
    uint64_t throttles;         /* statistics */
    uint64_t last_sched_ns;
    uint64_t kern_ns;           /* GPU ns of one kernel, from kernels bracketed one by one (the
                                 * first of each batch, every long one): gaps excluded */
    uint64_t queued_ns;         /* GPU work queued and not yet measured (set before decide) */
    int probe_pending;          /* the next launch's end gets an event (ev_probe) */
    /* Gap tracking of the open batch (alone on the card): before each launch the events behind
     * the latest launch on each of its streams (tails) are queried; all complete means the GPU
     * went idle, so the busy segment ended at the latest of them and a new one starts before
     * this launch. */
    int tracking;               /* the open batch is gap-tracked (peeked unlocked by the launch path):
                                 * the tracked batches it stands for, 0 = none */
    int ntails;                 /* its streams so far, each with a tail */
    void *tail[VGPU_BATCH_STREAMS];        /* CUevent re-recorded behind every launch on the stream */
    void *tail_stream[VGPU_BATCH_STREAMS];
    int tail_set[VGPU_BATCH_STREAMS];      /* recorded since the segment began */
    uint64_t track_after_ns;    /* CPU ns of recording a tail behind the last launch */
    uint32_t track_rng;         /* which batches are tracked (xorshift) */
    uint32_t gap_pm;            /* busy / span of tracked batches, per mille (EWMA); 0 = unknown */
    uint32_t gap_ppm;           /* the same in parts per million: the average's own precision */
    /* Busy calibration (alone on the card): the card's own busy time (NVML's utilization
     * samples) per measured GPU ns, per mille; every charge is scaled by it. 1000 = none. */
    uint32_t cal_pm;
    int cal_container;          /* cal_pm was set for the container's processes together */
    int cal_cont_moved;         /* ... and moved since (until then a step goes all the way) */
    uint64_t cal_last_ns;       /* the last calibration step (gate clock); 0 = none yet */
    uint64_t cal_waited_ns;     /* the launches' waits for credit since then */
    unsigned long long cal_seen_us; /* NVML timestamp of the newest utilization sample read */
    /* decayed sums (x 3/4 per step, ~2 s) of the card's busy ns and of the measured GPU ns in
     * the same spans (the samples') */
    uint64_t cal_card_busy, cal_own_busy;
    /* Gap-tracked batches' busy time and the event overhead taken off it (decayed sums): the
     * calibration may raise a charge by at most that overhead (vgpu_gate_cal_raise). */
    uint64_t seg_busy_sum, seg_ovh_sum;
    /* the measured GPU ns settled so far, as a time series: a point at most every
     * VGPU_CAL_POINT_NS, so the measured time in the samples' span can be read off */
    uint64_t cal_total_ns;
    uint64_t cal_pt_t[VGPU_CAL_POINTS], cal_pt_total[VGPU_CAL_POINTS];
    unsigned cal_pt_head, cal_pt_len;
#ifdef VGPU_STATS
    /* a diagnostic build only (VGPU_CFLAGS=-DVGPU_STATS shim/build.py): per settle mode 0-4,
     * batches, their measured span, what they were charged, their provisional charge (ns) */
    uint64_t st_n[6], st_span[6], st_charged[6], st_prov[6], st_launches[6];
    uint64_t st_tspan, st_tcpu; /* gap-tracked batches: spans, the tracking's CPU time in their gaps */
    uint64_t st_twice;          /* GPU ns charged already that later batches' spans held */
    /* and the last VGPU_TRACE_LEN decisions of the slow path (printed at exit) */
    struct vgpu_trace_ent {
        uint64_t now, ret, queued, est, open_until;
        int64_t credit; /* now - V, credit clock ns */
    } st_trace[VGPU_TRACE_LEN];
    uint64_t st_trace_n;
    /* and per second of the gate's life (from its first slow path): the launches' waits for
     * credit, and the credit clock's advance converted to GPU ns charged (ns) */
    uint64_t st_sec0, st_sec_wait[64], st_sec_vt[64];
#endif
};

void vgpu_gate_init(struct vgpu_gate *g, int cores, uint64_t period_ns);
/* Own window from the schedule (or own share at offset 0), offset and length in ns of the base
 * period, and whether others are listed (the window then repeats every frame, scaled to it). */
void vgpu_gate_set_window(struct vgpu_gate *g, uint64_t offset_ns, uint64_t len_ns, int cotenants);
/* The price of a launch at the current estimate, window and ratio (vt_cost, read by the fast
 * path): set again after any of them changed. */
void vgpu_gate_reprice(struct vgpu_gate *g);
/* Fast check: 1 if a launch may pass (it is then charged provisionally and counted), 0 = take
 * the slow path, which also a launch on a stream the open batch does not measure yet takes
 * (the batch measures each stream). The real time lies in [now_lo, now_hi] (a coarse
 * clock: lo = coarse, hi = coarse + margin; the precise one: lo = hi). */
int vgpu_gate_fast(struct vgpu_gate *g, uint64_t now_lo, uint64_t now_hi, void *stream);
/* Whether stream s is one of the open batch's measured streams (its first one or one it joined).
 * Peeked, so the fast path may call it unlocked (the fields are written under the gate's lock: a
 * stale answer sends a launch to the slow path, which asks again under the lock). Pure. */
int vgpu_gate_measures(struct vgpu_gate *g, void *s);
/* This thread, as the owner of its per-thread default stream: a number no other thread of the
 * process gets, taken on first use (not a TLS address: the C library hands an exited thread's
 * TLS block to the next thread it starts). Never 0. */
extern __thread uintptr_t vgpu_thread_tok;
uintptr_t vgpu_thread_token_new(void);
static inline uintptr_t vgpu_thread_token(void)
{
    uintptr_t t = vgpu_thread_tok;
    return __builtin_expect(t != 0, 1) ? t : vgpu_thread_token_new();
}
#define VGPU_STREAM_PER_THREAD ((void *)0x2) /* CU_STREAM_PER_THREAD */
/* 1 when a launch at a time in [now_lo, now_hi] may pass (the batch is open and, unless the gate
 * only measures, there is credit), stream aside. Pure. */
int vgpu_gate_open_at(struct vgpu_gate *g, uint64_t now_lo, uint64_t now_hi);
/* Credit above a bucket at time now_hi is dropped (V raised to now_hi - burst), as the slow path
 * drops it: a passing launch does it on the fast path. A tenant under its share gathers credit
 * faster than it spends it, and sending each of its launches to the slow path for that closed
 * its batch at nearly every launch (1.6 launches a batch for gpt at 60 % on the H200, a fifth of
 * its speed lost to event records with no wait at all). */
void vgpu_gate_clamp(struct vgpu_gate *g, uint64_t now_hi);
/* A launch that passes: charged its estimate (unless the gate only measures) and counted. */
void vgpu_gate_count(struct vgpu_gate *g);
/* The slow path's decision at `now`: 0 = pass (the fast path is open until g->open_until),
 * else the time to wait until before deciding again. Clamps the credit to the burst. Pure. */
uint64_t vgpu_gate_decide(struct vgpu_gate *g, uint64_t now);
/* A batch of `launches`, charged `prov_ns` provisionally, took `span_ns` of GPU time: correct
 * the credit clock and the per-launch estimate. measured: 0 = its events could not be read: the
 * provisional charge stands and a bucket is added (vgpu_gate_forfeit), 1 = the span between its events (idle gaps included), 2 = an upper
 * bound (idle tail included), 3 = exact (gap-tracked: the sum of its busy segments), 4 = a lower
 * bound (a stream whose events failed: the provisional charge stands unless the span is
 * longer, and the estimate is not moved), 5 = several streams, each measured (the union of their
 * spans, at most their sum). twice_ns of the span was charged already by an earlier batch
 * (vgpu_measure.c, "time charged twice"): taken off the charge, not off what the estimate learns
 * (a batch that has it moves the estimate not at all). Returns the GPU ns charged for it (0 when
 * its work is unknown). Pure. */
uint64_t vgpu_gate_settle(struct vgpu_gate *g, uint64_t launches, uint64_t prov_ns, uint64_t span_ns, uint64_t twice_ns,
                          int measured);
/* One gap-tracked batch: busy_ns of GPU time in a span of span_ns; the ratio charges the others.
 * weight: the tracked batches it stands for (vgpu_gate_track_every / VGPU_TRACK_EVERY, 1 to 4):
 * its step towards its share is that many times a normal one's (at most the whole way). Pure. */
void vgpu_gate_tracked(struct vgpu_gate *g, uint64_t busy_ns, uint64_t span_ns, uint32_t weight);
/* One batch in how many to gap-track at `hi` (now plus the coarse clock's margin: where the fast
 * path clamps the credit, vgpu_gate_clamp): VGPU_TRACK_UNDER_EVERY while this process's
 * measured busy share (busy_pm) is at least VGPU_TRACK_UNDER_HEADROOM_PM under the share AND the
 * container's credit (the shared clock V) is within 1/16 of a full bucket, else
 * VGPU_TRACK_EVERY. Pure. */
uint32_t vgpu_gate_track_every(const struct vgpu_gate *g, uint64_t hi);
/* One kernel's own GPU time (an event right before and right after it). */
void vgpu_gate_sample(struct vgpu_gate *g, uint64_t kern_ns);
void vgpu_gate_forfeit(struct vgpu_gate *g); /* a batch whose work is unknown: a bucket of GPU time */
/* Busy per mille published for the agent, from the measured GPU time since the last call. */
uint32_t vgpu_gate_busy(struct vgpu_gate *g, uint64_t now);
/* Between those calls: 1 (and busy_pm raised) when the share measured over the current interval,
 * at least VGPU_BUSY_RISE_MIN_NS long, is above the published one; else 0. Pure. */
int vgpu_gate_busy_rise(struct vgpu_gate *g, uint64_t now);
/* A gap-tracked batch's busy time (busy_ns, event overhead already taken off) and that overhead
 * (ovh_ns) into decayed sums. Pure. */
void vgpu_gate_seg_overhead(struct vgpu_gate *g, uint64_t busy_ns, uint64_t ovh_ns);
/* The most cal_pm may be now, per mille of the measured time: VGPU_CAL_MAX_PM bounded by what
 * the events themselves read (1000 plus the overhead taken off per busy time); 1000 where
 * nothing was taken off. Pure. */
uint32_t vgpu_gate_cal_raise(const struct vgpu_gate *g);
/* Record a point of the measured-time series at `now` (at most every VGPU_CAL_POINT_NS). */
void vgpu_gate_cal_note(struct vgpu_gate *g, uint64_t now);
/* The measured GPU ns settled in [t0, t1] (gate clock), read off the series by linear
 * interpolation; -1 (all ones) when the series does not cover t0. Pure. */
uint64_t vgpu_gate_cal_own(const struct vgpu_gate *g, uint64_t t0, uint64_t t1);
/* One calibration step: the card was busy card_busy_ns in [t0, t1] (its utilization samples'
 * span, in the gate's clock); `alone`: this process is the card's only compute process (only
 * then is the card's busy time its own). A span in which the tenant used at least half its
 * share adds the card's and its own measured busy time to decayed sums, and cal_pm becomes
 * their ratio within [VGPU_CAL_MIN_PM, vgpu_gate_cal_raise]; beside co-tenants or other processes,
 * 1000 and the sums start again. Pure. */
void vgpu_gate_calibrate(struct vgpu_gate *g, uint64_t t0, uint64_t t1, uint64_t card_busy_ns, int alone);
/* One calibration step of a process of a container the schedule lists alone on the card, with
 * other processes on it (`procs` compute processes in NVML's list): the card's busy time in
 * [t0, t1] is the container's, compared with the share of that span. Above it by more than
 * VGPU_CAL_CONT_BAND_PM, cal_pm rises part of the way (VGPU_CAL_CONT_UP_GAIN_PM) toward the
 * reading, all the way above VGPU_CAL_CONT_JUMP_PM (up to vgpu_gate_cal_raise); under it, and
 * only when this process waited for credit a quarter of the span or more (`waited_ns`: the
 * container is held back by charges its time does not bear out), it falls part of the way
 * (VGPU_CAL_CONT_GAIN_PM) toward the reading, taken as no lower than VGPU_CAL_CONT_STEP_PM, and
 * never below VGPU_CAL_MIN_PM / min(procs, VGPU_CAL_CONT_PROCS). The first step since the
 * process joined the container's ratio (cal_cont_moved 0) goes all the way either way. Beside
 * co-tenants: 1000, as vgpu_gate_calibrate. Pure. */
void vgpu_gate_calibrate_container(struct vgpu_gate *g, uint64_t t0, uint64_t t1, uint64_t card_busy_ns,
                                   unsigned procs, uint64_t waited_ns);
/* Read <dir>/<uuid>.sched (never written, never locked) and find `key`'s window. 0 with
 * offset/len in per mille of the period and its entry count in *count (may be NULL); -1 if the file is missing, short, not a schedule of
 * this version, inconsistent (a window beyond the period), or does not list `key`. */
int vgpu_sched_read(const char *dir, const char *uuid, const char *key, uint32_t *offset_pm,
                    uint32_t *len_pm, uint32_t *count);
uint64_t vgpu_now_ns(void);         /* CLOCK_MONOTONIC */
uint64_t vgpu_coarse_ns(void);      /* CLOCK_MONOTONIC_COARSE */
uint64_t vgpu_coarse_margin(void);  /* 2 x its resolution, ns */

/* ------------------------------------------------------------------ CUDA / NVML types */

#include "vgpu_types.h"

/* ------------------------------------------------------------------ shim runtime */

/* The hook list and tables: vgpu_hooks.h. */

/* Driver entry points the shim calls but does not hook, resolved once when the driver is bound
 * (vgpu_symbols_bind / vgpu_nvml_bind: under a pthread_once, before the hook table is
 * published); NULL where the driver lacks one. Read through vgpu_cuda_drv() / vgpu_nvml_drv(). */
struct vgpu_drv {
    CUresult (*device_get_count)(int *);
    CUresult (*device_get)(CUdevice *, int);
    CUresult (*device_get_uuid)(CUuuid *, CUdevice);          /* _v2 if the driver has it */
    CUresult (*device_get_attribute)(int *, int, CUdevice);
    CUresult (*ctx_get_device)(CUdevice *);
    CUresult (*ctx_get_current)(CUcontext *);
    CUresult (*ctx_get_limit)(size_t *, int);
    CUresult (*ctx_push)(CUcontext);                          /* _v2 */
    CUresult (*ctx_pop)(CUcontext *);                         /* _v2 */
    CUresult (*primary_ctx_release)(CUdevice);               /* _v2 */
    CUresult (*primary_ctx_get_state)(CUdevice, unsigned *, int *);
    CUresult (*stream_get_ctx)(CUstream, CUcontext *);
    CUresult (*stream_is_capturing)(CUstream, int *);
    CUresult (*stream_capture_info)(CUstream, int *, cuuint64_t *); /* cuStreamGetCaptureInfo (v1) */
    CUresult (*stream_query)(CUstream);
    CUresult (*event_create)(CUevent *, unsigned);
    CUresult (*event_destroy)(CUevent);                      /* _v2 */
    CUresult (*event_record)(CUevent, CUstream);
    CUresult (*event_query)(CUevent);
    CUresult (*event_elapsed)(float *, CUevent, CUevent);
    CUresult (*array_mem_req)(CUDA_ARRAY_MEMORY_REQUIREMENTS *, void *, CUdevice);
    CUresult (*mipmap_mem_req)(CUDA_ARRAY_MEMORY_REQUIREMENTS *, void *, CUdevice);
    CUresult (*graph_get_nodes)(void *, void **, size_t *);
    CUresult (*graph_node_type)(void *, int *);
    CUresult (*graph_mem_alloc_params)(void *, void *);
    CUresult (*graph_child_graph)(void *, void **);
    CUresult (*module_loading_mode)(int *);                   /* cuModuleGetLoadingMode */
    /* NVML */
    nvmlReturn_t (*nvml_init_v2)(void);
    nvmlReturn_t (*nvml_device_index)(nvmlDevice_t, unsigned *);
    nvmlReturn_t (*nvml_device_uuid)(nvmlDevice_t, char *, unsigned);
    nvmlReturn_t (*nvml_handle_by_uuid)(const char *, nvmlDevice_t *);
    nvmlReturn_t (*nvml_running_procs)(nvmlDevice_t, unsigned *, nvmlProcessInfo_t *); /* _v3, else _v2 */
    nvmlReturn_t (*nvml_samples)(nvmlDevice_t, int, unsigned long long, int *, unsigned *, nvmlSample_t *);
};

enum { VGPU_ST_INIT, VGPU_ST_CUINIT, VGPU_ST_MAP, VGPU_ST_NVML_INIT, VGPU_ST_NVML_PROCS, VGPU_ST_SLOT,
       VGPU_ST_CHARGE, VGPU_ST_CTX_DRIVER, VGPU_ST_COUNT };

/* Process state. Thread safety: fields are set once by vgpu_init (a pthread_once) or by the
 * device map (under map_mu, published by the release store of cuda_mapped), except where a
 * comment names the lock or says atomic. Fork: see vgpu_fork_* (libvgpu.c). */
struct vgpu_state {
    struct vgpu_config cfg;
    struct vgpu_region_handle region;
    int limited;                /* any limit active */
    int compute_limited;
    void *libcuda, *libnvml;
    /* CUDA ordinal -> region device index (-1 = not in the claim) */
    int cuda_map[VGPU_MAX_DEV];
    int cuda_mapped;
    uint64_t cuda_total[VGPU_MAX_DEV]; /* physical bytes per region device (0 = unknown) */
    struct vgpu_gate gate[VGPU_MAX_DEV];
    uint64_t coarse_margin;     /* vgpu_coarse_margin(), set with the device map */
    struct vgpu_drv drv;        /* optional driver symbols (see struct vgpu_drv) */
    /* reconciliation with NVML per-process usage (atomic: compare-and-swap of the time) */
    uint64_t last_reconcile_ns[VGPU_MAX_DEV];
    uint64_t last_reap_ns;      /* atomic: dead slots reaped at most every VGPU_REAP_NS */
    /* under nvml_mu (vgpu_nvml.c) */
    int nvml_inited;            /* the shim's own nvmlInit_v2 was called; result in nvml_init_rc */
    nvmlReturn_t nvml_init_rc;
    nvmlDevice_t nvml_handle[VGPU_MAX_DEV];      /* region device -> NVML handle (by UUID) */
    struct { nvmlDevice_t h; int d; } nvml_map[VGPU_MAX_DEV]; /* NVML handle -> region device */
    int nvml_nmap;
    /* contexts (vgpu_mem_ctx.c; atomic) */
    uint64_t ctx_learnt[VGPU_MAX_DEV];  /* bytes a context took on a region device (first one) */
    int primary_charged[VGPU_MAX_DEV];  /* by CUDA ordinal: its primary context is charged */
    void *primary_ctx[VGPU_MAX_DEV];     /* by CUDA ordinal: the handle its last retain returned */
    int primary_refs[VGPU_MAX_DEV];      /* by CUDA ordinal: retains seen less releases */
#ifdef VGPU_STATS
    /* a diagnostic build only: where a process's start-up time goes, ns (VGPU_ST_*) */
    uint64_t st_start[VGPU_ST_COUNT];
#endif
};
extern struct vgpu_state vgpu;

/* Start-up phases a statistics build times (printed at exit as vgpu-stats-start). */
#ifdef VGPU_STATS
#define VGPU_ST_T0(v) uint64_t v = vgpu_now_ns()
#define VGPU_ST_ADD(i, v) __atomic_add_fetch(&vgpu.st_start[i], vgpu_now_ns() - (v), __ATOMIC_RELAXED)
#else
#define VGPU_ST_T0(v) ((void)0)
#define VGPU_ST_ADD(i, v) ((void)0)
#endif

void vgpu_init(void);                /* idempotent; never calls CUDA */
int vgpu_cuda_ready(void);           /* 0 ok, else CUresult for fail-closed */
void vgpu_log(int level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
void *vgpu_real_dlsym(void *handle, const char *name);
void vgpu_symbols_bind(void);        /* dlopen libcuda, fill .real and vgpu.drv (once) */
void vgpu_nvml_bind(void);           /* dlopen libnvidia-ml, likewise (once) */
void *vgpu_real_cuda(int idx);
void *vgpu_real_nvml(int idx);
static inline const struct vgpu_drv *vgpu_cuda_drv(void)
{
    vgpu_symbols_bind();
    return &vgpu.drv;
}
static inline const struct vgpu_drv *vgpu_nvml_drv(void)
{
    vgpu_nvml_bind();
    return &vgpu.drv;
}
/* Fork (pthread_atfork, registered by vgpu_init in a limited process): prepare takes every
 * process-local lock of the shim in its order, parent releases them, child re-initialises them
 * and the per-process state (a new process: no slot, no allocations, no contexts). */
void vgpu_cuda_fork_prepare(void);
void vgpu_cuda_fork_parent(void);
void vgpu_cuda_fork_child(void);
void vgpu_nvml_fork_lock(int op);    /* 0 lock, 1 unlock, 2 re-initialise (vgpu_nvml.c) */
void *vgpu_cuda_sym(const char *name);   /* real libcuda symbol by name */
void *vgpu_nvml_sym(const char *name);   /* real libnvidia-ml symbol by name */
void *vgpu_hook_for(const char *name);   /* our wrapper for an exported name, or NULL */
int vgpu_map_cuda_device(CUdevice dev);  /* region device index for an ordinal, -1 none */
int vgpu_map_uuid(const char *uuid);     /* region device index for a UUID string, -1 none */
void vgpu_format_uuid(const CUuuid *u, char *out, size_t n);
/* NVML per-process usage -> overhead charge. force: 0 at most every VGPU_RECONCILE_NS, 2 near
 * the limit (VGPU_RECONCILE_NEAR_NS), 1 before a refusal (VGPU_RECONCILE_REFUSE_NS), 3 now. */
void vgpu_reconcile(int d, int force);
/* The next reconciliation on d runs whatever the rate (a charge changed that NVML should settle:
 * an array destroyed, a graph's charge moved to overhead). */
void vgpu_reconcile_soon(int d);
/* Reconcile d now (again when counts moved under the first pass) and tell whether the container
 * is over its limit there: 1 over, 0 not (or no limit). */
int vgpu_reconcile_over(int d);
void vgpu_compute_setup(int d, CUdevice dev);
/* The gate's slow path (vgpu_gate_inputs.c): the agent's window for card d, read at most every
 * VGPU_SCHED_REFRESH_NS; a busy calibration step from NVML's samples (at most every VGPU_CAL_NS,
 * the caller checks). */
void vgpu_gate_refresh_schedule(int d, uint64_t now);
void vgpu_gate_calibrate_now(int d, struct vgpu_gate *g, uint64_t now);
void vgpu_compute_gate(CUstream stream);
void vgpu_compute_sync(CUstream stream, int whole_ctx); /* before an app's wait: close the batch */
void vgpu_compute_synced(void);                         /* after it: settle what completed */
void vgpu_compute_ctx_destroy(CUcontext c);              /* before cuCtxDestroy: its events go */
void vgpu_compute_ctx_destroyed(CUcontext c);            /* after it: events may be made again */
uint64_t vgpu_nvml_process_used(int d, int *found); /* bytes NVML reports for this process */
/* The card's busy time in ns in NVML's utilization samples newer than *seen_us (each sample:
 * the percent of its period a kernel ran) and the span they cover, [*from_us, *seen_us] (NVML's
 * wall-clock microseconds); *alone: this process is the card's only compute process; *procs:
 * the card's compute processes (0 when NVML cannot list them). 1 when samples were read; the
 * first call (*seen_us 0) only finds the newest sample. */
int vgpu_nvml_card_busy(int d, unsigned long long *seen_us, unsigned long long *from_us, uint64_t *busy_ns,
                        int *alone, unsigned *procs);
void vgpu_ensure_slot(void);             /* take this process's region slot if not yet */

/* Decimal parsing without libc: glibc >= 2.38 headers turn strtol/strtoull/atoi into calls of
 * __isoc23_strtol*, which an image with an older glibc lacks (the shim would not load there).
 * Leading blanks, an optional sign for vgpu_atoi, then digits; stops at the first non-digit. */
static inline unsigned long long vgpu_atou(const char *s)
{
    unsigned long long v = 0;
    while (*s == ' ' || *s == '\t')
        s++;
    for (; *s >= '0' && *s <= '9'; s++)
        v = v * 10 + (unsigned)(*s - '0');
    return v;
}

static inline int vgpu_atoi(const char *s)
{
    while (*s == ' ' || *s == '\t')
        s++;
    int neg = *s == '-';
    if (*s == '-' || *s == '+')
        s++;
    unsigned long long v = vgpu_atou(s);
    if (v > 2147483647ull)
        v = 2147483647ull;
    return neg ? -(int)v : (int)v;
}

#endif
