/*
 * vgpu_region.c - the container's shared region: one quota for all its processes.
 *
 * A fixed-layout file (struct vgpu_region in vgpu.h, documented in docs/shim.md) mapped
 * MAP_SHARED by every process of the container and read by the node agent. Admission is a
 * reserve under one robust, process-shared mutex: check `used + bytes <= limit`, then charge
 * the device total and the caller's slot in the same critical section, so N racing
 * processes can never overshoot the limit together.
 *
 * Crash safety: the mutex is PTHREAD_MUTEX_ROBUST, so a holder that dies (SIGKILL) hands
 * the lock to the next locker with EOWNERDEAD; that locker recomputes every device total
 * from the live slots and marks the mutex consistent. A slot belongs to (pid, start time
 * from /proc/<pid>/stat), so a reused PID never inherits a dead process's charges. Dead
 * slots are reaped when a process joins, when an allocation would fail, and on recovery.
 *
 * One region can be shared across PID namespaces (a DRA ResourceClaim referenced by two pods,
 * or by two containers of a pod without shareProcessNamespace). A process can only judge the
 * slots of its own namespace by /proc; each slot records its namespace, and a slot of another
 * (or an unknown) namespace stays charged until the node agent, which sees every namespace,
 * marks it dead (dead_key). Never fail open: what cannot be judged stays charged.
 */
#include "vgpu.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <stddef.h>
#include <string.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <linux/stat.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

uint64_t vgpu_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

uint64_t vgpu_coarse_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC_COARSE, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

uint64_t vgpu_coarse_margin(void)
{
    struct timespec r;
    if (clock_getres(CLOCK_MONOTONIC_COARSE, &r) != 0 || r.tv_sec)
        return UINT64_MAX / 4; /* unusable: always ask the precise clock */
    return 2 * (uint64_t)r.tv_nsec;
}

uint64_t vgpu_proc_start_time(int32_t pid)
{
    char path[64], buf[1024];
    snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return 0;
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0)
        return 0;
    buf[n] = 0;
    char *p = strrchr(buf, ')'); /* comm may contain spaces and ')' */
    if (!p)
        return 0;
    /* after ") " comes field 3 (state); starttime is field 22 */
    if (p[1] == ' ' && (p[2] == 'Z' || p[2] == 'X'))
        return 0; /* zombie: gone for our purposes */
    for (int field = 2; field < 22 && p; field++)
        p = strchr(p + 1, ' ');
    return p ? vgpu_atou(p + 1) : 0;
}

struct vgpu_pidns vgpu_pidns_self(void)
{
    /* statx by syscall: stat/fstatat bind to GLIBC_2.33 symbols (see build.py's GLIBC_MAX). */
    struct statx sx;
    struct vgpu_pidns ns = {0, 0};
    memset(&sx, 0, sizeof sx);
    if (syscall(SYS_statx, AT_FDCWD, "/proc/self/ns/pid", 0, STATX_INO, &sx) != 0 || !sx.stx_ino)
        return ns;
    uint64_t ma = sx.stx_dev_major, mi = sx.stx_dev_minor; /* glibc's makedev(): st_dev as the
                                                             * agent's os.stat() sees it */
    ns.dev = ((ma & 0xfffff000ull) << 32) | ((ma & 0xfffull) << 8) | ((mi & 0xffffff00ull) << 12) |
             (mi & 0xffull);
    ns.ino = sx.stx_ino;
    return ns;
}

static int same_ns(const struct vgpu_slot *sl, struct vgpu_pidns ns)
{
    return ns.ino && sl->pidns_ino == ns.ino && sl->pidns_dev == ns.dev;
}

static void init_mutex(pthread_mutex_t *m)
{
    pthread_mutexattr_t a;
    pthread_mutexattr_init(&a);
    pthread_mutexattr_setpshared(&a, PTHREAD_PROCESS_SHARED);
    pthread_mutexattr_setrobust(&a, PTHREAD_MUTEX_ROBUST);
    pthread_mutex_init(m, &a);
    pthread_mutexattr_destroy(&a);
}

static void recompute_locked(struct vgpu_region *r)
{
    for (int d = 0; d < VGPU_MAX_DEV; d++) {
        uint64_t sum = 0;
        for (int s = 0; s < VGPU_MAX_SLOTS; s++)
            if (r->slot[s].pid)
                sum += r->slot[s].data[d] + r->slot[s].overhead[d];
        atomic_store(&r->dev[d].used, sum);
    }
}

__thread int vgpu_nocancel_depth;
__thread int vgpu_nocancel_saved;

/* Cancellation is held off from the lock to vgpu_region_unlock (or a failed lock's return). */
int vgpu_region_lock(struct vgpu_region *r)
{
    vgpu_nocancel_enter();
    int rc = pthread_mutex_lock(&r->lock.m);
    if (rc == EOWNERDEAD) {
        /* The holder died inside a critical section: its partial update is repaired by
         * dropping dead slots and recomputing the totals from the slots. */
        vgpu_region_reap_locked(r);
        recompute_locked(r);
        pthread_mutex_consistent(&r->lock.m);
        return 0;
    }
    if (rc == ENOTRECOVERABLE) {
        init_mutex(&r->lock.m);
        rc = pthread_mutex_lock(&r->lock.m);
    }
    if (rc != 0)
        vgpu_nocancel_leave();
    return rc == 0 ? 0 : -1;
}

void vgpu_region_unlock(struct vgpu_region *r)
{
    pthread_mutex_unlock(&r->lock.m);
    vgpu_nocancel_leave();
}

static void clear_slot_locked(struct vgpu_region *r, int s)
{
    struct vgpu_slot *sl = &r->slot[s];
    for (int d = 0; d < VGPU_MAX_DEV; d++) {
        uint64_t c = sl->data[d] + sl->overhead[d];
        uint64_t u = atomic_load(&r->dev[d].used);
        atomic_store(&r->dev[d].used, u > c ? u - c : 0);
    }
    /* data[] is read without the lock (vgpu_region_counted): cleared with atomic stores */
    for (int d = 0; d < VGPU_MAX_DEV; d++)
        VGPU_POKE(sl->data[d], 0);
    memset(sl, 0, offsetof(struct vgpu_slot, data));
    memset(&sl->overhead, 0, sizeof *sl - offsetof(struct vgpu_slot, overhead));
}

/* 1 when the slot's process is known to be gone: the agent's mark for this very (pid, start
 * time), or, in this process's namespace, /proc. */
static int slot_dead(const struct vgpu_slot *sl, struct vgpu_pidns self)
{
    uint64_t mark = VGPU_PEEK(sl->dead_key);
    if (mark && mark == VGPU_SLOT_KEY(sl->pid, sl->start_time))
        return 1;
    return same_ns(sl, self) && vgpu_proc_start_time(sl->pid) != sl->start_time;
}

int vgpu_region_reap_locked(struct vgpu_region *r)
{
    int n = 0;
    struct vgpu_pidns self = vgpu_pidns_self();
    for (int s = 0; s < VGPU_MAX_SLOTS; s++) {
        struct vgpu_slot *sl = &r->slot[s];
        if (sl->pid && slot_dead(sl, self)) {
            clear_slot_locked(r, s);
            n++;
        }
    }
    return n;
}

int vgpu_region_reap(struct vgpu_region *r)
{
    if (vgpu_region_lock(r) != 0)
        return 0;
    int n = vgpu_region_reap_locked(r);
    vgpu_region_unlock(r);
    return n;
}

static void apply_config_locked(struct vgpu_region *r, const struct vgpu_config *cfg)
{
    if (!cfg)
        return;
    r->ndev = (uint32_t)cfg->ndev;
    r->priority = (uint32_t)cfg->priority;
    snprintf(r->claim, sizeof r->claim, "%s", cfg->claim);
    for (int d = 0; d < VGPU_MAX_DEV; d++) {
        struct vgpu_region_dev *rd = &r->dev[d];
        if (d < cfg->ndev) {
            snprintf(rd->uuid, sizeof rd->uuid, "%s", cfg->dev[d].uuid);
            rd->limit = cfg->dev[d].mem_limit;
            rd->cores = (uint32_t)cfg->dev[d].cores;
        } else {
            rd->uuid[0] = 0;
            rd->limit = 0;
            rd->cores = 0;
        }
    }
}

/* 1 when the region carries no claim yet (fresh or re-initialised). */
static int unclaimed(const struct vgpu_region *r)
{
    return r->ndev == 0 && !r->claim[0];
}

/* 1 when cfg presents the claim the region was created with: same name, priority, devices
 * (UUIDs in claim mode; HAMi mode learns them from CUDA later), limits and cores. */
static int same_claim_locked(const struct vgpu_region *r, const struct vgpu_config *cfg)
{
    if (r->ndev != (uint32_t)cfg->ndev || r->priority != (uint32_t)cfg->priority ||
        strncmp(r->claim, cfg->claim, sizeof r->claim) != 0)
        return 0;
    for (int d = 0; d < cfg->ndev && d < VGPU_MAX_DEV; d++) {
        const struct vgpu_region_dev *rd = &r->dev[d];
        if (rd->limit != cfg->dev[d].mem_limit || rd->cores != (uint32_t)cfg->dev[d].cores)
            return 0;
        if (cfg->dev[d].uuid[0] && strncmp(rd->uuid, cfg->dev[d].uuid, sizeof rd->uuid) != 0)
            return 0;
    }
    return 1;
}

static int valid(const struct vgpu_region *r)
{
    return r->magic == VGPU_REGION_MAGIC && r->version == VGPU_REGION_VERSION &&
           r->size == sizeof *r && r->max_slots == VGPU_MAX_SLOTS;
}

static void init_region(struct vgpu_region *r)
{
    uint64_t gen = r->generation;
    memset(r, 0, sizeof *r);
    init_mutex(&r->lock.m);
    r->version = VGPU_REGION_VERSION;
    r->size = sizeof *r;
    r->max_slots = VGPU_MAX_SLOTS;
    r->generation = gen + 1;
    for (int d = 0; d < VGPU_MAX_DEV; d++)
        r->dev[d].unused = 0xffffffffu;
    __atomic_store_n(&r->magic, VGPU_REGION_MAGIC, __ATOMIC_RELEASE);
}

int vgpu_region_open(struct vgpu_region_handle *h, const char *path, const struct vgpu_config *cfg)
{
    memset(h, 0, sizeof *h);
    h->fd = -1;
    h->slot = -1;
    size_t sz = sizeof(struct vgpu_region);
    if (!path || !path[0]) {
        h->r = mmap(NULL, sz, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
        if (h->r == MAP_FAILED)
            return h->r = NULL, -1;
        h->private_map = 1;
        init_region(h->r);
        apply_config_locked(h->r, cfg);
        return 0;
    }
    int fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0666);
    if (fd < 0)
        return -1;
    fchmod(fd, 0666); /* every user of the container shares the quota */
    flock(fd, LOCK_EX); /* serialises creation and re-initialisation only */
    off_t fsz = lseek(fd, 0, SEEK_END);
    if (fsz < 0 || ((size_t)fsz < sz && ftruncate(fd, (off_t)sz) != 0)) {
        int e = errno;
        flock(fd, LOCK_UN);
        close(fd);
        return errno = e, -1;
    }
    struct vgpu_region *r = mmap(NULL, sz, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (r == MAP_FAILED) {
        int e = errno;
        flock(fd, LOCK_UN);
        close(fd);
        return errno = e, -1;
    }
    if (!valid(r))
        init_region(r);
    h->r = r;
    h->fd = fd;
    if (cfg) {
        /* The first claim fixes the region's limits; a process presenting another claim
         * (a forged env, another container's file) is refused, never obeyed. */
        int ok = 1;
        vgpu_region_lock(r);
        if (unclaimed(r))
            apply_config_locked(r, cfg);
        else
            ok = same_claim_locked(r, cfg);
        vgpu_region_unlock(r);
        if (!ok) {
            flock(fd, LOCK_UN);
            munmap(r, sz);
            close(fd);
            memset(h, 0, sizeof *h);
            h->fd = -1;
            h->slot = -1;
            return errno = EPERM, -1;
        }
    }
    flock(fd, LOCK_UN);
    return 0;
}

int vgpu_region_attach(struct vgpu_region_handle *h, const char *path)
{
    memset(h, 0, sizeof *h);
    h->slot = -1;
    int fd = open(path, O_RDWR | O_CLOEXEC);
    if (fd < 0)
        return -1;
    off_t fsz = lseek(fd, 0, SEEK_END); /* not fstat: fstat@GLIBC_2.33 (see build.py) */
    if (fsz < 0 || (size_t)fsz < sizeof(struct vgpu_region)) {
        close(fd);
        return errno = EINVAL, -1;
    }
    struct vgpu_region *r = mmap(NULL, sizeof *r, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (r == MAP_FAILED) {
        close(fd);
        return -1;
    }
    if (!valid(r)) {
        munmap(r, sizeof *r);
        close(fd);
        return errno = EPROTO, -1;
    }
    h->r = r;
    h->fd = fd;
    return 0;
}

void vgpu_region_close(struct vgpu_region_handle *h)
{
    if (h->r)
        munmap(h->r, sizeof *h->r);
    if (h->fd >= 0)
        close(h->fd);
    h->r = NULL;
    h->fd = -1;
    h->slot = -1;
}

int vgpu_region_join(struct vgpu_region_handle *h, int32_t pid, uint64_t start_time)
{
    struct vgpu_region *r = h->r;
    int free_slot = -1, mine = -1;
    struct vgpu_pidns self = vgpu_pidns_self();
    vgpu_region_lock(r);
    vgpu_region_reap_locked(r);
    for (int s = 0; s < VGPU_MAX_SLOTS; s++) {
        if (r->slot[s].pid == pid && same_ns(&r->slot[s], self)) {
            mine = s; /* same pid, namespace and start time survived the reap: our own old slot */
            break;
        }
        if (!r->slot[s].pid && free_slot < 0)
            free_slot = s;
    }
    if (mine >= 0)
        clear_slot_locked(r, mine);
    else
        mine = free_slot;
    if (mine >= 0) {
        r->slot[mine].pid = pid;
        r->slot[mine].start_time = start_time;
        r->slot[mine].pidns_dev = self.dev;
        r->slot[mine].pidns_ino = self.ino;
    }
    vgpu_region_unlock(r);
    __atomic_store_n(&h->slot, mine, __ATOMIC_RELEASE); /* the shim peeks at it unlocked */
    return mine;
}

void vgpu_region_leave(struct vgpu_region_handle *h)
{
    if (!h->r || h->slot < 0)
        return;
    vgpu_region_lock(h->r);
    clear_slot_locked(h->r, h->slot);
    vgpu_region_unlock(h->r);
    h->slot = -1;
}

int vgpu_region_reserve(struct vgpu_region_handle *h, int d, uint64_t bytes)
{
    struct vgpu_region *r = h->r;
    if (d < 0 || d >= VGPU_MAX_DEV || h->slot < 0)
        return 0;
    vgpu_region_lock(r);
    uint64_t used = atomic_load(&r->dev[d].used), limit = r->dev[d].limit;
    if (limit && (used + bytes > limit || used + bytes < used)) {
        /* Before refusing, return the quota of processes that died without cleaning up (at
         * most every VGPU_REAP_REFUSE_NS per process: each reap reads every slot's /proc entry
         * under the lock, and processes racing the limit refuse in a loop). */
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        uint64_t now = (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
        if ((!h->reaped_ns || now - h->reaped_ns >= VGPU_REAP_REFUSE_NS) && (h->reaped_ns = now) &&
            vgpu_region_reap_locked(r) > 0)
            used = atomic_load(&r->dev[d].used);
        if (used + bytes > limit || used + bytes < used) {
            vgpu_region_unlock(r);
            return -1;
        }
    }
    atomic_store(&r->dev[d].used, used + bytes);
    VGPU_POKE(r->slot[h->slot].data[d], r->slot[h->slot].data[d] + bytes);
    vgpu_region_unlock(r);
    return 0;
}

void vgpu_region_release(struct vgpu_region_handle *h, int d, uint64_t bytes)
{
    struct vgpu_region *r = h->r;
    if (d < 0 || d >= VGPU_MAX_DEV || h->slot < 0)
        return;
    vgpu_region_lock(r);
    struct vgpu_slot *sl = &r->slot[h->slot];
    if (bytes > sl->data[d])
        bytes = sl->data[d];
    VGPU_POKE(sl->data[d], sl->data[d] - bytes);
    uint64_t u = atomic_load(&r->dev[d].used);
    atomic_store(&r->dev[d].used, u > bytes ? u - bytes : 0);
    vgpu_region_unlock(r);
}

uint64_t vgpu_region_set_overhead(struct vgpu_region_handle *h, int d, uint64_t bytes)
{
    struct vgpu_region *r = h->r;
    if (d < 0 || d >= VGPU_MAX_DEV || h->slot < 0)
        return 0;
    vgpu_region_lock(r);
    /* Policy: overhead (context, modules, allocator rounding, pool caches: what NVML shows
     * above the counted allocations) is charged in full, even past the limit: the limit is
     * hard, so a slice smaller than a context gets every allocation refused (issue 21). */
    struct vgpu_slot *sl = &r->slot[h->slot];
    uint64_t u = atomic_load(&r->dev[d].used) - sl->overhead[d] + bytes;
    sl->overhead[d] = bytes;
    atomic_store(&r->dev[d].used, u);
    vgpu_region_unlock(r);
    return bytes;
}

void vgpu_region_counted(const struct vgpu_region *r, int d, uint64_t *out)
{
    /* without the lock (its holders write data[] with atomic stores): one more acquisition of a
     * lock every process shares, on every reconciliation, is what this saves */
    for (int s = 0; s < VGPU_MAX_SLOTS; s++)
        out[s] = d >= 0 && d < VGPU_MAX_DEV ? VGPU_PEEK(r->slot[s].data[d]) : 0;
}

/* The initial PID namespace's inode (PROC_PID_INIT_INO): PIDs there are the ones NVML lists. */
#define VGPU_PID_INIT_INO 0xEFFFFFFCull

/* The PID NVML lists slot s's process under, 0 when it cannot be told: the node agent's host_pid,
 * else its own PID for this process (as before the agent wrote it) or for a sibling when both are
 * in the host's PID namespace (a container's PID may be another process's host PID). */
static uint32_t nvml_pid_of(const struct vgpu_slot *sl, int own, struct vgpu_pidns self)
{
    if (!sl->pid)
        return 0;
    if (sl->host_pid)
        return (uint32_t)sl->host_pid;
    return own || (same_ns(sl, self) && self.ino == VGPU_PID_INIT_INO) ? (uint32_t)sl->pid : 0;
}

static const struct vgpu_nvml_proc *listed(const struct vgpu_nvml_proc *procs, unsigned n, uint32_t pid)
{
    for (unsigned i = 0; pid && i < n; i++)
        if (procs[i].pid == pid)
            return &procs[i];
    return NULL;
}

int vgpu_region_reconcile(struct vgpu_region_handle *h, int d, const uint64_t *before,
                          const struct vgpu_nvml_proc *procs, unsigned n, struct vgpu_pidns self)
{
    struct vgpu_region *r = h->r;
    if (d < 0 || d >= VGPU_MAX_DEV || vgpu_region_lock(r) != 0)
        return 0;
    int found = 0;
    uint64_t u = atomic_load(&r->dev[d].used);
    for (int s = 0; s < VGPU_MAX_SLOTS; s++) {
        struct vgpu_slot *sl = &r->slot[s];
        const struct vgpu_nvml_proc *p = listed(procs, n, nvml_pid_of(sl, s == h->slot, self));
        if (!p)
            continue;
        int own = s == h->slot, moved = sl->data[d] != before[s];
        found |= (own ? VGPU_RECON_OWN : 0) | (moved ? VGPU_RECON_MOVED : 0);
        uint64_t data = sl->data[d] < before[s] ? sl->data[d] : before[s];
        uint64_t bytes = p->used > data ? p->used - data : 0;
        /* A sibling's own, maybe newer, figure stands: raised here, never lowered, and not from a
         * pass its count moved under (the sibling is active and reconciles itself; an inflated
         * raise would stay until it did, and the slice's last pages go unused). */
        if (!own && (moved || bytes < sl->overhead[d]))
            continue;
        u = u - sl->overhead[d] + bytes;
        sl->overhead[d] = bytes;
    }
    atomic_store(&r->dev[d].used, u);
    vgpu_region_unlock(r);
    return found;
}

void vgpu_region_to_overhead(struct vgpu_region_handle *h, int d, uint64_t bytes)
{
    struct vgpu_region *r = h->r;
    if (d < 0 || d >= VGPU_MAX_DEV || h->slot < 0 || vgpu_region_lock(r) != 0)
        return;
    struct vgpu_slot *sl = &r->slot[h->slot];
    uint64_t b = bytes < sl->data[d] ? bytes : sl->data[d];
    VGPU_POKE(sl->data[d], sl->data[d] - b);
    sl->overhead[d] += b;
    vgpu_region_unlock(r);
}

uint64_t vgpu_region_used(struct vgpu_region *r, int d)
{
    return (d >= 0 && d < VGPU_MAX_DEV) ? atomic_load(&r->dev[d].used) : 0;
}

int vgpu_region_oom_victim(struct vgpu_region *r, int d, uint64_t slack, int32_t *pid,
                           uint64_t *start_time, uint64_t *bytes)
{
    if (d < 0 || d >= VGPU_MAX_DEV || vgpu_region_lock(r) != 0)
        return 0;
    vgpu_region_reap_locked(r);
    struct vgpu_pidns self = vgpu_pidns_self(); /* a PID of another namespace is not ours to kill */
    uint64_t used = atomic_load(&r->dev[d].used), lim = r->dev[d].limit;
    int best = -1;
    uint64_t most = 0;
    if (lim && used > lim && used - lim > slack)
        for (int s = 0; s < VGPU_MAX_SLOTS; s++) {
            const struct vgpu_slot *sl = &r->slot[s];
            uint64_t b = sl->data[d] + sl->overhead[d];
            if (sl->pid && same_ns(sl, self) && (best < 0 || b > most))
                best = s, most = b;
        }
    if (best >= 0)
        *pid = r->slot[best].pid, *start_time = r->slot[best].start_time, *bytes = most;
    vgpu_region_unlock(r);
    return best >= 0;
}

void vgpu_region_oom_record(struct vgpu_region *r, int d, int32_t pid, uint64_t bytes)
{
    if (vgpu_region_lock(r) != 0)
        return;
    atomic_fetch_add(&r->oom_kills, 1);
    r->oom_last_pid = pid;
    r->oom_last_dev = (uint32_t)d;
    r->oom_last_bytes = bytes;
    r->oom_last_used = d >= 0 && d < VGPU_MAX_DEV ? atomic_load(&r->dev[d].used) : 0;
    vgpu_region_unlock(r);
}
