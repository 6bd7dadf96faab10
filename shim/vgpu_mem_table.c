/*
 * vgpu_mem_table.c - the memory units' bookkeeping (vgpu_mem.h): the per-process allocation
 * table (object -> bytes, device), charging against the shared region before the driver is asked
 * and the commit/rollback steps every create and free path ends with, this process's region slot,
 * the memory units' locks across fork, and ACTIVE_OOM_KILLER. The accounting rule and what each
 * path charges: vgpu_cuda_mem.c.
 */
#include "vgpu_mem.h"

#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* ------------------------------------------------------------------ allocation table */

/* ctx: the context whose end frees the object (vgpu_tab_mark_ctx, vgpu_tab_end_mark), or the
 * token it was marked with while that end is under way; 0: none (pool and VMM memory, contexts
 * and their limits, bookkeeping) */
struct aent { uint64_t key; uint64_t size; int32_t dev; int32_t kind; uint64_t ctx; };
static struct aent *tab;
static size_t tab_cap, tab_used; /* used counts live + tombstones */
static pthread_mutex_t tab_mu = PTHREAD_MUTEX_INITIALIZER;

static size_t slot_of(uint64_t key, int kind, size_t cap)
{
    return (size_t)(((key ^ ((uint64_t)kind << 56)) * 0x9e3779b97f4a7c15ull) >> 17) & (cap - 1);
}

static void tab_grow(void)
{
    size_t ncap = tab_cap ? tab_cap * 2 : 1024;
    struct aent *n = calloc(ncap, sizeof *n);
    if (!n)
        return;
    size_t live = 0;
    for (size_t i = 0; i < tab_cap; i++) {
        if (tab[i].kind <= 0)
            continue;
        size_t j = slot_of(tab[i].key, tab[i].kind, ncap);
        while (n[j].kind)
            j = (j + 1) & (ncap - 1);
        n[j] = tab[i];
        live++;
    }
    free(tab);
    tab = n, tab_cap = ncap, tab_used = live;
}

static void tab_put(int kind, uint64_t key, uint64_t size, int dev, uint64_t ctx)
{
    vgpu_lock(&tab_mu);
    if ((tab_used + 1) * 2 >= tab_cap)
        tab_grow();
    if (tab_cap) {
        /* the whole probe chain: an entry of this key may sit past a tombstone (replaced, never
         * doubled); otherwise the first tombstone or the empty slot that ends the chain */
        size_t j = slot_of(key, kind, tab_cap), at = (size_t)-1;
        while (tab[j].kind && !(tab[j].kind == kind && tab[j].key == key)) {
            if (tab[j].kind < 0 && at == (size_t)-1)
                at = j;
            j = (j + 1) & (tab_cap - 1);
        }
        if (tab[j].kind == 0 && at != (size_t)-1)
            j = at;
        else if (tab[j].kind == 0)
            tab_used++;
        tab[j] = (struct aent){key, size, dev, kind, ctx};
    }
    vgpu_unlock(&tab_mu);
}

void vgpu_tab_put(int kind, uint64_t key, uint64_t size, int dev)
{
    tab_put(kind, key, size, dev, 0);
}

void vgpu_tab_put_owned(int kind, uint64_t key, uint64_t size, int dev)
{
    CUcontext cur = NULL;
    CUresult (*get)(CUcontext *) = vgpu_cuda_drv()->ctx_get_current;
    if (!get || get(&cur) != CUDA_SUCCESS)
        cur = NULL;
    tab_put(kind, key, size, dev, (uint64_t)(uintptr_t)cur);
}

uint64_t vgpu_tab_mark_ctx(uint64_t ctx)
{
    static _Atomic uint64_t serial;
    if (!ctx)
        return 0;
    uint64_t token = (1ull << 63) | (atomic_fetch_add(&serial, 1) + 1); /* never a handle */
    vgpu_lock(&tab_mu);
    for (size_t j = 0; j < tab_cap; j++)
        if (tab[j].kind > 0 && tab[j].ctx == ctx)
            tab[j].ctx = token;
    vgpu_unlock(&tab_mu);
    return token;
}

void vgpu_tab_end_mark(uint64_t token, uint64_t ctx, int gone)
{
    uint64_t freed[VGPU_MAX_DEV] = {0};
    if (!token)
        return;
    vgpu_lock(&tab_mu);
    for (size_t j = 0; j < tab_cap; j++) {
        if (tab[j].kind <= 0 || tab[j].ctx != token)
            continue;
        if (!gone) {
            tab[j].ctx = ctx;
            continue;
        }
        if (tab[j].dev >= 0 && tab[j].dev < VGPU_MAX_DEV)
            freed[tab[j].dev] += tab[j].size;
        tab[j].kind = K_TOMB;
    }
    vgpu_unlock(&tab_mu);
    for (int d = 0; d < VGPU_MAX_DEV; d++)
        if (freed[d])
            vgpu_uncharge(d, freed[d]);
}

void vgpu_tab_drop_kind(int kind)
{
    vgpu_lock(&tab_mu);
    for (size_t j = 0; j < tab_cap; j++)
        if (tab[j].kind == kind)
            tab[j].kind = K_TOMB;
    vgpu_unlock(&tab_mu);
}

/* What a take on this thread found besides size and device: the entry's owner (vgpu_release_end
 * puts a failed free back with it; the pair runs on one thread with only the driver call between). */
static __thread uint64_t taken_ctx;

/* The entry of (kind, key), removed when `take`; under tab_mu. */
static int tab_find(int kind, uint64_t key, uint64_t *size, int *dev, int take)
{
    if (!tab_cap)
        return 0;
    for (size_t j = slot_of(key, kind, tab_cap); tab[j].kind; j = (j + 1) & (tab_cap - 1))
        if (tab[j].kind == kind && tab[j].key == key) {
            *size = tab[j].size, *dev = tab[j].dev, taken_ctx = tab[j].ctx;
            if (take)
                tab[j].kind = K_TOMB;
            return 1;
        }
    return 0;
}

int vgpu_tab_take(int kind, uint64_t key, uint64_t *size, int *dev)
{
    vgpu_lock(&tab_mu);
    int found = tab_find(kind, key, size, dev, 1);
    vgpu_unlock(&tab_mu);
    return found;
}

int vgpu_tab_get(int kind, uint64_t key, uint64_t *size, int *dev)
{
    vgpu_lock(&tab_mu);
    int found = tab_find(kind, key, size, dev, 0);
    vgpu_unlock(&tab_mu);
    return found;
}

static pthread_mutex_t join_mu = PTHREAD_MUTEX_INITIALIZER;
pthread_mutex_t vgpu_primary_mu = PTHREAD_MUTEX_INITIALIZER; /* vgpu_mem_ctx.c; here for fork */
pthread_mutex_t vgpu_vmm_mu = PTHREAD_MUTEX_INITIALIZER;     /* vgpu_mem_vmm.c; here for fork */

void vgpu_cuda_mem_fork_lock(int op)
{
    switch (op) {
    case 0: pthread_mutex_lock(&vgpu_primary_mu); break;
    case 1: pthread_mutex_lock(&vgpu_vmm_mu), pthread_mutex_lock(&join_mu); break;
    case 2: pthread_mutex_lock(&tab_mu); break;
    case 3:
        pthread_mutex_unlock(&tab_mu);
        pthread_mutex_unlock(&join_mu);
        pthread_mutex_unlock(&vgpu_vmm_mu);
        pthread_mutex_unlock(&vgpu_primary_mu);
        break;
    case 4:
        pthread_mutex_init(&vgpu_primary_mu, NULL);
        pthread_mutex_init(&vgpu_vmm_mu, NULL);
        pthread_mutex_init(&join_mu, NULL);
        pthread_mutex_init(&tab_mu, NULL);
        free(tab);
        tab = NULL, tab_cap = tab_used = 0;
        vgpu_vmm_fork_child();
        memset(vgpu.primary_charged, 0, sizeof vgpu.primary_charged);
        memset(vgpu.primary_ctx, 0, sizeof vgpu.primary_ctx);
        memset(vgpu.primary_refs, 0, sizeof vgpu.primary_refs);
        break;
    }
}

/* ------------------------------------------------------------------ charging */

void vgpu_ensure_slot(void)
{
    if (__atomic_load_n(&vgpu.region.slot, __ATOMIC_ACQUIRE) >= 0)
        return;
    vgpu_lock(&join_mu);
    if (vgpu.region.slot < 0) {
        int32_t pid = (int32_t)getpid();
        static int told; /* under join_mu */
        if (vgpu_region_join(&vgpu.region, pid, vgpu_proc_start_time(pid)) < 0 && !told++)
            vgpu_log(0, "shared region has no free slot (%d processes): allocations are refused",
                     VGPU_MAX_SLOTS);
    }
    vgpu_unlock(&join_mu);
}

/* 0: charged (or nothing to charge), -1: refuse with CUDA_ERROR_OUT_OF_MEMORY. */
int vgpu_charge(int d, uint64_t bytes)
{
    if (d == -1)
        return 0;
    if (d == -2) {
        vgpu_log(1, "allocation on a device outside the claim refused");
        return -1;
    }
    vgpu_ensure_slot();
    if (vgpu.region.slot < 0)
        return -1; /* no slot: this process could not be counted, so it gets nothing */
    struct vgpu_region *r = vgpu.region.r;
    uint64_t lim = r->dev[d].limit, used = vgpu_region_used(r, d);
    if (lim)
        vgpu_reconcile(d, used + bytes > lim - lim / 10 ? 2 : 0);
    if (vgpu_region_reserve(&vgpu.region, d, bytes) == 0)
        return 0;
    vgpu_vmm_settle(); /* sparse-array unmaps the GPU has done return their handles' charges */
    vgpu_reconcile(d, 1);
    if (vgpu_region_reserve(&vgpu.region, d, bytes) == 0)
        return 0;
    vgpu_log(2, "device %d: out of memory: %llu MiB asked, %llu of %llu MiB charged", d,
             (unsigned long long)(bytes >> 20), (unsigned long long)(vgpu_region_used(r, d) >> 20),
             (unsigned long long)(lim >> 20));
    return -1;
}

uint64_t vgpu_uncharges;

void vgpu_uncharge(int d, uint64_t bytes)
{
    if (d < 0)
        return;
    __atomic_add_fetch(&vgpu_uncharges, 1, __ATOMIC_RELAXED);
    vgpu_region_release(&vgpu.region, d, bytes);
}

/* Every free/destroy path: a tracked object leaves the table before the driver call (so an
 * address the driver hands out again at once is never confused with it) and is uncharged when
 * the call succeeds; when it fails, the object goes back. release_begin is 0 for objects the
 * shim does not track (limits off, or allocated before it), which then pass straight through. */
int vgpu_release_begin(int kind, uint64_t key, uint64_t *size, int *d)
{
    taken_ctx = 0;
    return mode() == M_LIMITED && vgpu_tab_take(kind, key, size, d);
}

CUresult vgpu_release_end(CUresult rc, int kind, uint64_t key, uint64_t size, int d)
{
    if (rc == CUDA_SUCCESS)
        vgpu_uncharge(d, size);
    else /* with the owner it had: a free made to fail cannot move it to a context about to end */
        tab_put(kind, key, size, d, taken_ctx);
    return rc;
}

/* Every create path charges before the driver call (vgpu_charge()); after it, alloc_end commits the
 * object to the table when the driver made it (rc success, an object to record: `made`, `key`)
 * on a device of the claim, and otherwise returns the charge. */
static CUresult alloc_end(CUresult rc, int made, int kind, uint64_t key, uint64_t size, int d, int owned)
{
    if (rc != CUDA_SUCCESS || d < 0 || !made)
        vgpu_uncharge(d, size);
    else if (owned)
        vgpu_tab_put_owned(kind, key, size, d);
    else
        vgpu_tab_put(kind, key, size, d);
    return rc;
}

CUresult vgpu_alloc_end(CUresult rc, int made, int kind, uint64_t key, uint64_t size, int d)
{
    return alloc_end(rc, made, kind, key, size, d, 0);
}

CUresult vgpu_alloc_end_owned(CUresult rc, int made, int kind, uint64_t key, uint64_t size, int d)
{
    return alloc_end(rc, made, kind, key, size, d, 1);
}

/* Paths that charge an estimate first (pitch, arrays): once the object exists, settle the charge
 * to the driver's figure `actual`. 0: `actual` is charged; -1: the difference does not fit and
 * nothing is charged any more (the caller destroys the object and refuses). */
int vgpu_settle(int d, uint64_t est, uint64_t actual)
{
    if (actual > est && vgpu_charge(d, actual - est)) {
        vgpu_uncharge(d, est);
        return -1;
    }
    if (actual < est)
        vgpu_uncharge(d, est - actual);
    return 0;
}

/* ------------------------------------------------------------------ ACTIVE_OOM_KILLER */

/* What the shim cannot refuse (memory NVML shows and no hook saw: device malloc beyond what was
 * charged, lazily loaded modules, library workspaces, pool caches) can still take the container
 * over its limit. With ACTIVE_OOM_KILLER=true, a reconciliation that finds the container over its
 * limit by more than the allocator's rounding between two reconciliations (1 % of the limit,
 * at least 8 MiB) ends the process with the most memory on that card in the container (itself,
 * or a sibling: same PID namespace, checked against its start time), with SIGKILL, logged and
 * counted in the region (the node agent reports it: a pod Event and a metric). */
void vgpu_oom_check(int d)
{
    if (!vgpu.cfg.oom_killer || d < 0 || !vgpu.region.r)
        return;
    struct vgpu_region *r = vgpu.region.r;
    uint64_t lim = r->dev[d].limit;
    if (!lim || vgpu_region_used(r, d) <= lim)
        return;
    uint64_t slack = lim / 100 > 8 * VGPU_MIB ? lim / 100 : 8 * VGPU_MIB, bytes = 0, start = 0;
    int32_t pid = 0;
    if (vgpu_region_oom_victim(r, d, slack, &pid, &start, &bytes) != 1)
        return;
    uint64_t used = vgpu_region_used(r, d);
    int self = pid == (int32_t)getpid();
    vgpu_log(0, "device %d: the container is over its memory limit (%llu of %llu MiB charged, memory "
                "the shim could not refuse); ACTIVE_OOM_KILLER: killing %sPID %d, which holds %llu MiB",
             d, (unsigned long long)(used >> 20), (unsigned long long)(lim >> 20), self ? "this process, " : "",
             (int)pid, (unsigned long long)(bytes >> 20));
    if (!self && vgpu_proc_start_time(pid) != start)
        return; /* gone meanwhile: its slot is reaped, the charge returns */
    vgpu_region_oom_record(r, d, pid, bytes);
    if (self) {
        raise(SIGKILL);
        return;
    }
    if (kill(pid, SIGKILL) != 0) {
        vgpu_log(0, "device %d: could not kill PID %d: %m (the node agent's check is the backstop)", d,
                 (int)pid);
        return;
    }
    /* The caller is usually an allocation that would otherwise be refused: give the victim up
     * to 100 ms to go, then return its charge (its slot is reaped once it is gone). */
    for (uint64_t t = 0; t < VGPU_OOM_GRACE_NS && vgpu_proc_start_time(pid) == start;
         t += VGPU_OOM_POLL_US * 1000ull)
        usleep(VGPU_OOM_POLL_US);
    vgpu_region_reap(r);
}
