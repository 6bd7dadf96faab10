/* hidden_probe - what a real driver does with device memory that allocation hooks do not see,
 * without the shim: each experiment's change of the card's used memory (cuMemGetInfo, device-wide:
 * run it alone on the card), one JSON line each. E1 a graph allocation without a free node after
 * cuGraphExecDestroy / cuMemFree / cuDeviceGraphMemTrim; E2 a cuMemFreeAsync of stream-ordered
 * memory captured into a graph; E3 1-byte 3D arrays: their element-size estimate against what
 * they take, and cuArrayGetMemoryRequirements on them; E4 the device runtime's limits; E5 a
 * module with a 2 GiB __device__ global; E6 a kernel with 16 KiB of local memory per thread; E7
 * the default pool's cache with the release threshold at its maximum; E8 legacy IPC, the
 * exporter freeing while the importer (a child) keeps it open. The shim's rules for each:
 * docs/shim.md; results: docs/gpu-results.md.
 *
 * Device call: gcc -O2 -o /tmp/hidden_probe bench/gpu/hidden_probe.c -l:libcuda.so.1 && /tmp/hidden_probe
 */
#define _GNU_SOURCE
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <sys/wait.h>
typedef int CUresult; typedef int CUdevice; typedef unsigned long long CUdeviceptr;
typedef void *CUcontext, *CUstream, *CUgraph, *CUgraphNode, *CUgraphExec, *CUmodule, *CUfunction, *CUarray, *CUmemoryPool;
typedef struct { struct { int allocType, handleTypes; struct { int type, id; } location; void *w; unsigned char r[64]; } poolProps;
  const void *accessDescs; size_t accessDescCount; size_t bytesize; CUdeviceptr dptr; } ANP;
typedef struct { size_t W, H, D; int fmt; unsigned ch, flags; } A3D;
typedef struct { size_t size, align; unsigned r[4]; } AREQ;
typedef struct { char b[64]; } IPCH;
CUresult cuInit(unsigned); CUresult cuDeviceGet(CUdevice *, int); CUresult cuDevicePrimaryCtxRetain(CUcontext *, CUdevice);
CUresult cuCtxSetCurrent(CUcontext); CUresult cuMemGetInfo_v2(size_t *, size_t *); CUresult cuMemAlloc_v2(CUdeviceptr *, size_t);
CUresult cuMemFree_v2(CUdeviceptr); CUresult cuMemAllocAsync(CUdeviceptr *, size_t, CUstream); CUresult cuMemFreeAsync(CUdeviceptr, CUstream);
CUresult cuStreamCreate(CUstream *, unsigned); CUresult cuStreamBeginCapture_v2(CUstream, int); CUresult cuStreamEndCapture(CUstream, CUgraph *);
CUresult cuStreamSynchronize(CUstream); CUresult cuCtxSynchronize(void); CUresult cuGraphCreate(CUgraph *, unsigned);
CUresult cuGraphAddMemAllocNode(CUgraphNode *, CUgraph, const CUgraphNode *, size_t, ANP *);
CUresult cuGraphInstantiateWithFlags(CUgraphExec *, CUgraph, unsigned long long); CUresult cuGraphLaunch(CUgraphExec, CUstream);
CUresult cuGraphExecDestroy(CUgraphExec); CUresult cuGraphDestroy(CUgraph); CUresult cuDeviceGraphMemTrim(CUdevice);
CUresult cuArray3DCreate_v2(CUarray *, const A3D *); CUresult cuArrayDestroy(CUarray); CUresult cuArrayGetMemoryRequirements(AREQ *, CUarray, CUdevice);
CUresult cuCtxSetLimit(int, size_t); CUresult cuModuleLoadData(CUmodule *, const void *); CUresult cuModuleGetFunction(CUfunction *, CUmodule, const char *);
CUresult cuModuleUnload(CUmodule);
CUresult cuLaunchKernel(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, CUstream, void **, void **);
CUresult cuDeviceGetDefaultMemPool(CUmemoryPool *, CUdevice); CUresult cuMemPoolSetAttribute(CUmemoryPool, int, void *);
CUresult cuMemPoolTrimTo(CUmemoryPool, size_t);
CUresult cuIpcGetMemHandle(IPCH *, CUdeviceptr); CUresult cuIpcOpenMemHandle_v2(CUdeviceptr *, IPCH, unsigned); CUresult cuIpcCloseMemHandle(CUdeviceptr);
static long used(void) { size_t f, t; cuCtxSynchronize(); cuMemGetInfo_v2(&f, &t); return (long)((t - f) >> 20); }
#define MIB (1ull << 20)
static const char *ptx_global =
  ".version 7.0\n.target sm_52\n.address_size 64\n.visible .global .align 16 .b8 big[2147483648];\n"
  ".visible .entry k0() { .reg .u64 %a; .reg .u32 %r; mov.u64 %a, big; mov.u32 %r, 1; st.global.u32 [%a], %r; ret; }\n";
static const char *ptx_local =
  ".version 7.0\n.target sm_52\n.address_size 64\n"
  ".visible .entry kl(.param .u64 out, .param .u32 idx) {\n .local .align 16 .b8 buf[16384];\n"
  " .reg .u64 %o, %l, %m, %i64; .reg .u32 %i, %j, %v;\n ld.param.u64 %o, [out]; ld.param.u32 %i, [idx];\n"
  " mov.u64 %l, buf; cvt.u64.u32 %i64, %i; add.u64 %m, %l, %i64; mov.u32 %v, 7; st.local.u32 [%m], %v;\n"
  " mul.lo.u32 %j, %i, 3; and.b32 %j, %j, 16380; cvt.u64.u32 %i64, %j; add.u64 %m, %l, %i64; ld.local.u32 %v, [%m];\n"
  " st.global.u32 [%o], %v; ret; }\n";
int main(void)
{
  setvbuf(stdout, NULL, _IOLBF, 0);
  int pfd[2], back[2]; pipe(pfd); pipe(back);
  pid_t child = fork();
  if (child == 0) { /* IPC importer */
    IPCH h; CUdevice d; CUcontext c; CUdeviceptr p;
    if (read(pfd[0], &h, sizeof h) != sizeof h) _exit(1);
    cuInit(0); cuDeviceGet(&d, 0); cuDevicePrimaryCtxRetain(&c, d); cuCtxSetCurrent(c);
    int rc = cuIpcOpenMemHandle_v2(&p, h, 1); write(back[1], &rc, sizeof rc);
    char x; read(pfd[0], &x, 1); _exit(0);
  }
  CUdevice d; CUcontext c; CUstream s;
  cuInit(0); cuDeviceGet(&d, 0); cuDevicePrimaryCtxRetain(&c, d); cuCtxSetCurrent(c); cuStreamCreate(&s, 1);
  long u0 = used(), u1, u2, u3;
  printf("{\"base_used_mib\": %ld}\n", u0);
  { /* E1: graph allocation without a free node, exec and graph destroyed */
    CUgraph g; CUgraphNode n; CUgraphExec e; ANP p; memset(&p, 0, sizeof p);
    p.poolProps.allocType = 1, p.poolProps.location.type = 1, p.poolProps.location.id = d; p.bytesize = 1024 * MIB;
    int r1 = cuGraphCreate(&g, 0), r2 = cuGraphAddMemAllocNode(&n, g, 0, 0, &p), r3 = cuGraphInstantiateWithFlags(&e, g, 0);
    u1 = used(); int r4 = cuGraphLaunch(e, s); cuStreamSynchronize(s); u2 = used();
    int r5 = cuGraphExecDestroy(e); cuGraphDestroy(g); cuDeviceGraphMemTrim(d); u3 = used();
    int r6 = cuMemFree_v2(p.dptr); long u4 = used(); cuDeviceGraphMemTrim(d); long u5 = used();
    printf("{\"E1_graph_no_free\": [%d,%d,%d,%d,%d,%d], \"inst\": %ld, \"launched\": %ld, \"exec_destroyed_trimmed\": %ld, \"after_cuMemFree\": %ld, \"trim\": %ld}\n",
           r1, r2, r3, r4, r5, r6, u1 - u0, u2 - u0, u3 - u0, u4 - u0, u5 - u0);
  }
  u0 = used();
  { /* E2: cuMemFreeAsync of a cuMemAllocAsync pointer inside a capture */
    CUdeviceptr p; CUgraph g = 0; int a = cuMemAllocAsync(&p, 256 * MIB, s); cuStreamSynchronize(s);
    int b = cuStreamBeginCapture_v2(s, 2), f = cuMemFreeAsync(p, s), e = cuStreamEndCapture(s, &g);
    u1 = used(); int f2 = cuMemFreeAsync(p, s); cuStreamSynchronize(s);
    printf("{\"E2_captured_free\": {\"alloc\": %d, \"begin\": %d, \"free_in_capture\": %d, \"end\": %d, \"graph\": %d, \"held_after_capture\": %ld, \"free_again\": %d}}\n",
           a, b, f, e, g != 0, u1 - u0, f2);
  }
  { /* E3: arrays: estimate (W*H*D*1B) vs the card's figure; cuArrayGetMemoryRequirements on a plain array */
    size_t shapes[][3] = {{1, 16384, 2048}, {16, 16, 16384}, {4096, 4096, 16}, {1, 65536, 0}};
    for (int i = 0; i < 4; i++) {
      A3D a = {shapes[i][0], shapes[i][1], shapes[i][2], 0x01, 1, 0}; CUarray arr; AREQ q; memset(&q, 0, sizeof q);
      u0 = used(); int rc = cuArray3DCreate_v2(&arr, &a); u1 = used(); int qr = cuArrayGetMemoryRequirements(&q, arr, d);
      printf("{\"E3_array\": [%zu,%zu,%zu], \"rc\": %d, \"est_kib\": %zu, \"took_mib\": %ld, \"memreq_rc\": %d, \"memreq_mib\": %zu}\n",
             a.W, a.H, a.D, rc, a.W * a.H * (a.D ? a.D : 1) / 1024, u1 - u0, qr, q.size >> 20);
      if (!rc) cuArrayDestroy(arr);
    }
  }
  { /* E4: device-runtime limits (not charged by the shim) */
    u0 = used(); int r = cuCtxSetLimit(4, 1 << 20); u1 = used(); int r2 = cuCtxSetLimit(3, 8); u2 = used();
    printf("{\"E4_pending_launch_1M\": %d, \"took_mib\": %ld, \"sync_depth_8\": %d, \"took2_mib\": %ld}\n", r, u1 - u0, r2, u2 - u1);
  }
  { /* E5: a module with a 2 GiB __device__ global */
    CUmodule m; u0 = used(); int r = cuModuleLoadData(&m, ptx_global); u1 = used();
    printf("{\"E5_module_2GiB_global\": %d, \"took_mib\": %ld}\n", r, u1 - u0);
    if (!r) cuModuleUnload(m);
  }
  { /* E6: a kernel with 16 KiB of local memory per thread: the driver grows the context's local memory at launch */
    CUmodule m; CUfunction f; CUdeviceptr o; cuMemAlloc_v2(&o, 4096); unsigned idx = 100;
    int r = cuModuleLoadData(&m, ptx_local); if (!r) r = cuModuleGetFunction(&f, m, "kl");
    void *args[] = {&o, &idx}; u0 = used();
    int l = r ? -1 : cuLaunchKernel(f, 1, 1, 1, 32, 1, 1, 0, s, args, 0); cuStreamSynchronize(s); u1 = used();
    printf("{\"E6_local_16KiB\": [%d,%d], \"took_mib\": %ld}\n", r, l, u1 - u0);
  }
  { /* E7: pool cache: default pool, release threshold max, 1 GiB alloc + free */
    CUmemoryPool pool; uint64_t thr = ~0ull; CUdeviceptr p; cuDeviceGetDefaultMemPool(&pool, d);
    int r = cuMemPoolSetAttribute(pool, 4, &thr); u0 = used();
    cuMemAllocAsync(&p, 1024 * MIB, s); cuMemFreeAsync(p, s); cuStreamSynchronize(s); u1 = used();
    cuMemPoolTrimTo(pool, 0); u2 = used();
    printf("{\"E7_pool_cache\": %d, \"held_after_free_mib\": %ld, \"after_trim_mib\": %ld}\n", r, u1 - u0, u2 - u0);
  }
  { /* E8: legacy IPC: the exporter frees while the importer has it open */
    CUdeviceptr p; IPCH h; int orc = -9; u0 = used();
    int a = cuMemAlloc_v2(&p, 1024 * MIB), g = cuIpcGetMemHandle(&h, p); write(pfd[1], &h, sizeof h);
    read(back[0], &orc, sizeof orc); u1 = used(); int f = cuMemFree_v2(p); sleep(1); u2 = used();
    write(pfd[1], "x", 1); waitpid(child, NULL, 0); sleep(1); u3 = used();
    printf("{\"E8_ipc\": [%d,%d,%d,%d], \"held_both\": %ld, \"after_exporter_free\": %ld, \"after_importer_exit\": %ld}\n",
           a, g, orc, f, u1 - u0, u2 - u0, u3 - u0);
  }
  return 0;
}
