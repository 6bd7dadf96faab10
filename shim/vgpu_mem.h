/*
 * vgpu_mem.h - what the memory units share: the allocation table, charging and the steps every
 * create and free path ends with (vgpu_mem_table.c). Internal to the memory units:
 *   vgpu_cuda_mem.c   memory info, linear and stream-ordered allocations (the accounting rule)
 *   vgpu_mem_vmm.c    VMM handles (cuMemCreate) and their mappings
 *   vgpu_mem_array.c  arrays and mipmapped arrays
 *   vgpu_mem_graph.c  graph memory nodes
 *   vgpu_mem_ctx.c    contexts and their limits
 *   vgpu_mem_module.c modules and libraries
 *   vgpu_mem_table.c  the table, charging, the region slot, fork, ACTIVE_OOM_KILLER
 */
#ifndef VGPU_MEM_H
#define VGPU_MEM_H

#include "vgpu_cuda.h"

/* What a table entry records: its kind and key (pointer, handle, array, exec, context). */
enum {
    K_PTR = 1, K_HANDLE = 2, K_ARRAY = 3, K_MIPMAP = 4, K_GRAPH = 5, /* K_GRAPH: exec launched once */
    K_CTX = 6,          /* a context this process created (or a primary one): its charge */
    K_LIM = 8,          /* + CU_LIMIT_*: bytes charged for a context's limit above its base */
    K_LIMBASE = 12,     /* + CU_LIMIT_*: the driver's value before our first change */
    K_GPEND = 32,       /* + region device: graph memory of an exec, known, not yet charged */
    K_GCHG = 48,        /* + region device: graph memory of an exec, charged */
    K_HMAPS = 64,       /* a tracked VMM handle: its live mappings (vgpu_mem_vmm.c) */
    K_HREFS = 65,       /* ... its references (absent: the create's one) */
    K_MAPLEN = 66,      /* a mapping's address: its length */
    K_MAPH = 67,        /* ... its handle */
    K_POOL = 68,        /* a memory pool made on or handed out for a card: its region device */
    K_HEXP = 69,        /* a tracked VMM handle exported: it holds one reference more (vgpu_mem_vmm.c) */
    K_GREEN = 70,       /* a green context this process created: its charge (vgpu_mem_ctx.c) */
    K_LOADED = 71,      /* a library or kernel measured loaded in a context (vgpu_mem_module.c) */
    K_TOMB = -1
};

/* The per-process table (under its own lock): put replaces an entry of the same kind and key;
 * take removes one, 1 with its size and device, 0 if there is none; get reads one in place. */
void vgpu_tab_put(int kind, uint64_t key, uint64_t size, int dev);
/* put, owned by the current context: memory the context's end frees (cuMemAlloc, pitch,
 * arrays), which vgpu_tab_end_mark then uncharges */
void vgpu_tab_put_owned(int kind, uint64_t key, uint64_t size, int dev);
/* Before the driver ends context ctx (destroy, a primary one's reset or release): mark the
 * objects it owns now with a token (returned; 0 for ctx 0). After the driver's answer, end_mark
 * drops the marked ones and returns their charges (`gone`: the context ended) or gives them back
 * to ctx. Objects recorded in between (another thread, maybe in a context that got the same
 * handle) are not marked: at worst over-charged, never dropped alive. */
uint64_t vgpu_tab_mark_ctx(uint64_t ctx);
void vgpu_tab_end_mark(uint64_t token, uint64_t ctx, int gone);
int vgpu_tab_take(int kind, uint64_t key, uint64_t *size, int *dev);
int vgpu_tab_get(int kind, uint64_t key, uint64_t *size, int *dev);
/* Every entry of `kind` removed (bookkeeping without charges: K_LOADED). */
void vgpu_tab_drop_kind(int kind);
/* After an unload or a context's end: the functions and libraries watched so far are forgotten
 * (the driver may hand their handles out again), so their next use is watched (vgpu_mem_module.c). */
void vgpu_module_forget(void);

/* Charge `bytes` to region device d (-1: not limited, nothing to charge; -2: a device outside
 * the claim, refused) before the driver is asked: 0 charged, -1 refuse with
 * CUDA_ERROR_OUT_OF_MEMORY. uncharge returns a charge (d < 0: nothing). */
int vgpu_charge(int d, uint64_t bytes);
void vgpu_uncharge(int d, uint64_t bytes);
/* How many uncharges this process made (atomic): a free during a watched call may hide the
 * memory the call took from the card's free figure (vgpu_mem_module.c). */
extern uint64_t vgpu_uncharges;

/* Free paths: begin takes a tracked object out of the table (0: not tracked, pass through);
 * end uncharges it when the driver call succeeded and puts it back when it failed. */
int vgpu_release_begin(int kind, uint64_t key, uint64_t *size, int *d);
CUresult vgpu_release_end(CUresult rc, int kind, uint64_t key, uint64_t size, int d);
/* Create paths, after the driver call: record the object or return its charge. */
CUresult vgpu_alloc_end(CUresult rc, int made, int kind, uint64_t key, uint64_t size, int d);
/* The same for an object the current context owns (vgpu_tab_put_owned). */
CUresult vgpu_alloc_end_owned(CUresult rc, int made, int kind, uint64_t key, uint64_t size, int d);
/* Estimate-first paths: settle the charge `est` to `actual`; -1 when the rest does not fit
 * (then nothing is charged). */
int vgpu_settle(int d, uint64_t est, uint64_t actual);

/* Serialises the first cuDevicePrimaryCtxRetain of a card (vgpu_mem_ctx.c); defined with the
 * other memory locks, which vgpu_cuda_mem_fork_lock takes across fork. */
extern pthread_mutex_t vgpu_primary_mu;
/* Serialises the VMM bookkeeping (vgpu_mem_vmm.c): taken before the table's and the region's. */
extern pthread_mutex_t vgpu_vmm_mu;
/* A sparse array or mipmapped array the driver destroyed (under vgpu_vmm_mu, held across the
 * destroy): the handles mapped into it are no longer held by it (vgpu_mem_vmm.c). */
void vgpu_vmm_array_gone(const void *res);
/* In a forked child: the parent's sparse-array bookkeeping is forgotten. */
void vgpu_vmm_fork_child(void);
/* Sparse-array unmaps whose event completed end their mappings now (takes vgpu_vmm_mu: never
 * called with it held; cheap when none waits). */
void vgpu_vmm_settle(void);

#endif
