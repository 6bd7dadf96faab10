/*
 * vgpu_mem_graph.c - graph memory: the memory nodes of executable graphs, recorded at
 * instantiation and charged at the first launch (vgpu_mem_graph_launch, called by the launch
 * hook in vgpu_launch.c) or upload, until cuGraphExecDestroy (then it becomes overhead, which
 * reconciliation settles to what the driver still holds: a live allocation, the pool's pages).
 */
#include "vgpu_mem.h"

#include <stdlib.h>
#include <string.h>

/* ------------------------------------------------------------------ graph memory */

/* Graph memory nodes (cuGraphAddMemAllocNode, cudaGraphAddMemAllocNode, or cuMemAllocAsync in a
 * capturing stream) are not allocations the hooks see: the driver reserves their memory in the
 * graph pool at the executable graph's first launch (or cuGraphUpload). So at instantiation the
 * graph is walked (child graphs too) and the bytes of its memory nodes are recorded per card
 * (K_GPEND); the first launch or upload charges them before the driver is asked and is refused
 * with CUDA_ERROR_OUT_OF_MEMORY when they do not fit; the charge (K_GCHG) lasts until
 * cuGraphExecDestroy. Policy: every executable graph is charged its own nodes in full, although
 * the driver may let graphs share physical pages (safe side: never under the real use). */

static void graph_walk(CUgraph g, uint64_t *per_dev, int depth)
{
    const struct vgpu_drv *drv = vgpu_cuda_drv();
    CUresult (*nodes)(CUgraph, CUgraphNode *, size_t *) = (CUresult(*)(CUgraph, CUgraphNode *, size_t *))drv->graph_get_nodes;
    CUresult (*type)(CUgraphNode, int *) = (CUresult(*)(CUgraphNode, int *))drv->graph_node_type;
    CUresult (*params)(CUgraphNode, CUDA_MEM_ALLOC_NODE_PARAMS *) =
        (CUresult(*)(CUgraphNode, CUDA_MEM_ALLOC_NODE_PARAMS *))drv->graph_mem_alloc_params;
    CUresult (*child)(CUgraphNode, CUgraph *) = (CUresult(*)(CUgraphNode, CUgraph *))drv->graph_child_graph;
    size_t n = 0;
    if (!nodes || !type || !g || depth > 8 || nodes(g, NULL, &n) != CUDA_SUCCESS || !n)
        return;
    CUgraphNode *v = calloc(n, sizeof *v);
    if (!v || nodes(g, v, &n) != CUDA_SUCCESS) {
        free(v);
        return;
    }
    for (size_t i = 0; i < n; i++) {
        int t = -1;
        if (type(v[i], &t) != CUDA_SUCCESS)
            continue;
        CUDA_MEM_ALLOC_NODE_PARAMS p;
        CUgraph sub;
        if (t == CU_GRAPH_NODE_TYPE_MEM_ALLOC && params) {
            memset(&p, 0, sizeof p);
            if (params(v[i], &p) != CUDA_SUCCESS || p.poolProps.location.type != CU_MEM_LOCATION_TYPE_DEVICE)
                continue;
            int d = vgpu_map_cuda_device(p.poolProps.location.id);
            if (d >= 0)
                per_dev[d] += p.bytesize;
        } else if (t == CU_GRAPH_NODE_TYPE_GRAPH && child && child(v[i], &sub) == CUDA_SUCCESS) {
            graph_walk(sub, per_dev, depth + 1);
        }
    }
    free(v);
}

static void graph_record(CUgraphExec e, CUgraph g)
{
    uint64_t per_dev[VGPU_MAX_DEV] = {0};
    graph_walk(g, per_dev, 0);
    for (int d = 0; d < VGPU_MAX_DEV; d++)
        if (per_dev[d]) {
            vgpu_tab_put(K_GPEND + d, (uint64_t)(uintptr_t)e, per_dev[d], d);
            vgpu_log(3, "graph exec %p: %llu MiB of memory nodes on device %d", (void *)e,
                     (unsigned long long)(per_dev[d] >> 20), d);
        }
}

/* Charge the pending graph memory of e (first launch or upload). 0 ok (or nothing pending),
 * -1 refused: nothing is charged and it stays pending. */
static int graph_reserve(CUgraphExec e)
{
    uint64_t key = (uint64_t)(uintptr_t)e, size[VGPU_MAX_DEV] = {0};
    int dev, got = 0;
    for (int d = 0; d < vgpu.cfg.ndev && d < VGPU_MAX_DEV; d++)
        if (vgpu_tab_take(K_GPEND + d, key, &size[d], &dev))
            got = 1;
    if (!got)
        return 0;
    for (int d = 0; d < vgpu.cfg.ndev && d < VGPU_MAX_DEV; d++) {
        if (!size[d] || vgpu_charge(d, size[d]) == 0)
            continue;
        vgpu_log(1, "device %d: graph launch refused: its memory nodes need %llu MiB, %llu of %llu MiB "
                    "are charged", d, (unsigned long long)(size[d] >> 20),
                 (unsigned long long)(vgpu_region_used(vgpu.region.r, d) >> 20),
                 (unsigned long long)(vgpu.region.r->dev[d].limit >> 20));
        for (int k = 0; k < d; k++)
            if (size[k])
                vgpu_uncharge(k, size[k]);
        for (int k = 0; k < vgpu.cfg.ndev && k < VGPU_MAX_DEV; k++)
            if (size[k])
                vgpu_tab_put(K_GPEND + k, key, size[k], k);
        return -1;
    }
    for (int d = 0; d < vgpu.cfg.ndev && d < VGPU_MAX_DEV; d++)
        if (size[d])
            vgpu_tab_put(K_GCHG + d, key, size[d], d);
    return 0;
}

/* A launch or upload that failed after graph_reserve: the charge goes back to pending. */
static void graph_unreserve(CUgraphExec e)
{
    uint64_t key = (uint64_t)(uintptr_t)e, size;
    int dev;
    for (int d = 0; d < vgpu.cfg.ndev && d < VGPU_MAX_DEV; d++)
        if (vgpu_tab_take(K_GCHG + d, key, &size, &dev)) {
            vgpu_uncharge(d, size);
            vgpu_tab_put(K_GPEND + d, key, size, d);
        }
}

CUresult vgpu_mem_graph_launch(int idx, CUgraphExec g, CUstream s)
{
    vgpu_fn_cuGraphLaunch real = REAL(idx, vgpu_fn_cuGraphLaunch);
    /* A graph launch while the container is already over its limit is refused; the memory
     * nodes recorded at instantiation are charged at the first launch (graph_reserve), and
     * whatever else the launch makes the driver reserve is reconciled right after it. */
    int d = vgpu_cur_dev();
    if (d >= 0 && vgpu.region.r->dev[d].limit) {
        vgpu_reconcile(d, 0);
        if (vgpu_region_used(vgpu.region.r, d) > vgpu.region.r->dev[d].limit)
            return CUDA_ERROR_OUT_OF_MEMORY;
    }
    if (graph_reserve(g))
        return CUDA_ERROR_OUT_OF_MEMORY;
    uint64_t seen_size;
    int seen_dev, first = !vgpu_tab_take(K_GRAPH, (uint64_t)(uintptr_t)g, &seen_size, &seen_dev);
    vgpu_tab_put(K_GRAPH, (uint64_t)(uintptr_t)g, 0, d);
    CUresult rc = real(g, s);
    if (rc != CUDA_SUCCESS && first) {
        graph_unreserve(g);
        vgpu_tab_take(K_GRAPH, (uint64_t)(uintptr_t)g, &seen_size, &seen_dev);
    }
    if (rc == CUDA_SUCCESS && first && d >= 0)
        vgpu_reconcile(d, 3);
    return rc;
}

/* After every instantiation: the new exec's memory nodes become pending charges. */
static CUresult graph_instantiated(CUresult rc, CUgraphExec *e, CUgraph g)
{
    if (rc == CUDA_SUCCESS && e && mode() == M_LIMITED)
        graph_record(*e, g);
    return rc;
}

VGPU_API CUresult cuGraphInstantiate(CUgraphExec *e, CUgraph g, CUgraphNode *err, char *log, size_t n)
{
    BROKEN_GUARD();
    CUresult rc = REAL_FN(cuGraphInstantiate)(e, g, err, log, n);
    return graph_instantiated(rc, e, g);
}

VGPU_API CUresult cuGraphInstantiate_v2(CUgraphExec *e, CUgraph g, CUgraphNode *err, char *log, size_t n)
{
    BROKEN_GUARD();
    CUresult rc = REAL_FN(cuGraphInstantiate_v2)(e, g, err, log, n);
    return graph_instantiated(rc, e, g);
}

VGPU_API CUresult cuGraphInstantiateWithFlags(CUgraphExec *e, CUgraph g, unsigned long long flags)
{
    BROKEN_GUARD();
    CUresult rc = REAL_FN(cuGraphInstantiateWithFlags)(e, g, flags);
    return graph_instantiated(rc, e, g);
}

VGPU_API CUresult cuGraphInstantiateWithParams(CUgraphExec *e, CUgraph g, void *params)
{
    BROKEN_GUARD();
    CUresult rc = REAL_FN(cuGraphInstantiateWithParams)(e, g, params);
    return graph_instantiated(rc, e, g);
}

static CUresult graph_upload(int idx, CUgraphExec e, CUstream s)
{
    vgpu_fn_cuGraphUpload real = REAL(idx, vgpu_fn_cuGraphUpload);
    if (mode() != M_LIMITED)
        return real(e, s);
    if (graph_reserve(e))
        return CUDA_ERROR_OUT_OF_MEMORY;
    CUresult rc = real(e, s);
    if (rc != CUDA_SUCCESS)
        graph_unreserve(e);
    return rc;
}

VGPU_API CUresult cuGraphUpload(CUgraphExec e, CUstream s)
{
    BROKEN_GUARD();
    return graph_upload(H_GUPLOAD, e, s);
}

VGPU_API CUresult cuGraphUpload_ptsz(CUgraphExec e, CUstream s)
{
    BROKEN_GUARD();
    return graph_upload(H_GUPLOAD_PTSZ, e, s);
}

VGPU_API CUresult cuGraphExecDestroy(CUgraphExec e)
{
    BROKEN_GUARD();
    CUresult rc = REAL_FN(cuGraphExecDestroy)(e);
    if (rc != CUDA_SUCCESS || mode() != M_LIMITED)
        return rc;
    uint64_t key = (uint64_t)(uintptr_t)e, size;
    int dev;
    for (int d = 0; d < vgpu.cfg.ndev && d < VGPU_MAX_DEV; d++) {
        if (vgpu_tab_take(K_GCHG + d, key, &size, &dev)) {
            /* Graph destruction does not free a live graph allocation (one no free node or
             * cuMemFree has freed yet), nor may the driver give back the pool's pages: the charge
             * becomes overhead, which the next reconciliation (this process's next allocation, or
             * any sibling's) settles to what NVML still shows. */
            vgpu_region_to_overhead(&vgpu.region, d, size);
            vgpu_reconcile_soon(d);
        }
        vgpu_tab_take(K_GPEND + d, key, &size, &dev);
    }
    vgpu_tab_take(K_GRAPH, key, &size, &dev);
    return rc;
}
