/*
 * Shared state of the stub driver (libcuda.so.1 + libnvidia-ml.so.1 stand-ins for CPU CI).
 * One mmap'ed file (STUB_STATE) shared by every process of a test, so the "card" has one
 * physical memory and one execution queue that all processes compete for.
 *
 * Env: STUB_NDEV (1..4, default 1), STUB_MEM_MIB (per card, default 1024), STUB_CTX_MIB
 * (memory a context takes, default 64), STUB_KERNEL_US (GPU time per launch, default 1000),
 * STUB_STATE (state file; default: private to the process), STUB_UUIDS (the cards' UUIDs, comma-separated), STUB_GPA_INDIRECT=1
 * (cuGetProcAddress hands out trampolines instead of the exported addresses),
 * STUB_NULL_LAUNCH=1 (launches return at once: for measuring the shim's own cost),
 * STUB_GRID_US=1 (a kernel takes gridDimX microseconds instead of STUB_KERNEL_US),
 * STUB_TIMESLICE=1 (contexts of different processes share the card's time instead of queueing
 * behind each other: see the processor-sharing clock in libcuda_stub.c).
 */
#ifndef STUB_STATE_H
#define STUB_STATE_H
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#define STUB_MAXDEV 4
#define STUB_MAXPROC 256

struct stub_proc {
    _Atomic int32_t pid;
    _Atomic uint64_t used[STUB_MAXDEV];    /* bytes this process holds (NVML per-process) */
    _Atomic uint64_t busy_ns[STUB_MAXDEV]; /* GPU time of its launches */
    _Atomic uint64_t launches[STUB_MAXDEV];
    _Atomic uint64_t busy_until[STUB_MAXDEV]; /* STUB_TIMESLICE: end of its own queued work, on
                                               * its card's shared clock (struct stub_ps) */
};
/* STUB_TIMESLICE: each card's processor-sharing clock. R counts the GPU time each process with
 * work has received: it advances at 1/k of wall time while k processes have work queued (1 while
 * none has), so a process's work of d ns queued at R ends when R has advanced d, however many
 * processes come and go meanwhile. `bp`: the points where its rate changed, to map a value of R
 * back to wall time. */
#define STUB_PS_BP 16384
struct stub_ps {
    _Atomic int lock;
    uint64_t t, R;  /* R at wall time t */
    uint32_t k;     /* processes with work since t */
    uint64_t nbp;   /* breakpoints so far */
    struct { uint64_t t, R, k; } bp[STUB_PS_BP];
};
struct stub_state {
    uint32_t magic;
    _Atomic uint64_t busy_until[STUB_MAXDEV]; /* end of the queued work on each card */
    struct stub_proc proc[STUB_MAXPROC];
    struct stub_ps ps[STUB_MAXDEV];
};

static struct stub_state *stub_st;

static inline uint64_t stub_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static inline long stub_env(const char *n, long dflt)
{
    const char *v = getenv(n);
    return v && *v ? atol(v) : dflt;
}

static inline struct stub_state *stub_state(void)
{
    if (stub_st)
        return stub_st;
    const char *path = getenv("STUB_STATE");
    void *m = MAP_FAILED;
    if (path && *path) {
        int fd = open(path, O_RDWR | O_CREAT, 0666);
        if (fd >= 0) {
            if (ftruncate(fd, sizeof(struct stub_state)) == 0)
                m = mmap(NULL, sizeof(struct stub_state), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
            close(fd);
        }
    }
    if (m == MAP_FAILED)
        m = mmap(NULL, sizeof(struct stub_state), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    stub_st = m;
    return stub_st;
}

/* This process's row (created on first use, reused if the pid is already there). */
static inline struct stub_proc *stub_me(void)
{
    static __thread int cached_pid;
    static __thread struct stub_proc *cached;
    int32_t pid = getpid();
    if (cached && cached_pid == pid)
        return cached;
    struct stub_state *s = stub_state();
    for (int i = 0; i < STUB_MAXPROC; i++)
        if (atomic_load(&s->proc[i].pid) == pid)
            return cached_pid = pid, cached = &s->proc[i];
    for (int i = 0; i < STUB_MAXPROC; i++) {
        int32_t z = atomic_load(&s->proc[i].pid);
        if (z && (kill(z, 0) == 0 || errno != ESRCH))
            continue; /* a live process's row (a dead one's is reused: fork tests make many) */
        if (atomic_compare_exchange_strong(&s->proc[i].pid, &z, pid)) {
            for (int d = 0; d < STUB_MAXDEV; d++)
                s->proc[i].used[d] = s->proc[i].busy_ns[d] = s->proc[i].launches[d] = s->proc[i].busy_until[d] = 0;
            return cached_pid = pid, cached = &s->proc[i];
        }
    }
    return NULL;
}

static inline int stub_alive(int32_t pid)
{
    return pid > 0 && kill(pid, 0) == 0;
}

static inline uint64_t stub_dev_used(int phys)
{
    struct stub_state *s = stub_state();
    uint64_t sum = 0;
    for (int i = 0; i < STUB_MAXPROC; i++) {
        int32_t pid = atomic_load(&s->proc[i].pid);
        if (pid && stub_alive(pid))
            sum += atomic_load(&s->proc[i].used[phys]);
    }
    return sum;
}

/* Card phys's UUID: entry phys of STUB_UUIDS ("GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx,...", as a
 * simulated node's device plugin sets it, so the stub reports the cards the claim names), else
 * GPU-5a110000-0000-0000-0000-0000000000<phys>. */
static inline void stub_uuid_bytes(int phys, unsigned char b[16])
{
    memset(b, 0, 16);
    b[0] = 0x5a, b[1] = 0x11, b[15] = (unsigned char)phys;
    const char *v = getenv("STUB_UUIDS");
    for (int i = 0; v && i < phys; i++) {
        v = strchr(v, ',');
        v = v ? v + 1 : NULL;
    }
    if (!v || strncmp(v, "GPU-", 4))
        return;
    unsigned char t[16];
    int n = 0;
    for (const char *c = v + 4; *c && *c != ',' && n < 32; c++) {
        if (*c == '-')
            continue;
        int x = (*c >= '0' && *c <= '9') ? *c - '0' : (*c >= 'a' && *c <= 'f') ? *c - 'a' + 10 : -1;
        if (x < 0)
            return;
        t[n / 2] = (unsigned char)(n % 2 ? (t[n / 2] | x) : x << 4);
        n++;
    }
    if (n == 32)
        memcpy(b, t, 16);
}
#endif
