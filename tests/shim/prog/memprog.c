/*
 * memprog - memory the allocation hooks do not see, for the shim's tests (stub driver) and the
 * GPU bench (real driver). Driver API only, no CUDA headers. One JSON object per line.
 *
 *   memprog graph MODE MIB CHUNK [keep]  a graph with a MIB memory node and no free node (MODE add:
 *       cuGraphAddMemAllocNode, capture: cuMemAllocAsync in a capturing stream, child: inside a
 *       child graph), instantiated and launched twice (its allocation freed with cuMemFree in
 *       between, as CUDA requires), then CHUNK allocations until refused; the allocation freed
 *       (keep: left live, as graph destruction does not free it) and the exec destroyed, again
 *   memprog ctx N CHUNK [v1]       N extra contexts (cuCtxCreate_v2; v1: the CUDA < 3.2 cuCtxCreate
 *       through cuGetProcAddress at 3010), then CHUNK allocations until refused; the contexts
 *       destroyed, again
 *   memprog green N CHUNK          N green contexts (cuGreenCtxCreate on the card's whole SM
 *       resource), then CHUNK allocations until refused; the green contexts destroyed, again
 *   memprog limit WHICH VALUE CHUNK  cuCtxSetLimit(WHICH, VALUE), then CHUNK allocations
 *   memprog hidden N CHUNK MIB HOLD_S  N chunks, then MIB of memory without an allocation call
 *       (the stub's stubHidden; a device malloc on a GPU), a cuMemGetInfo and one more chunk,
 *       then hold
 *   memprog hide MIB HOLD_S        MIB of memory without an allocation call, then HOLD_S seconds
 *       without any CUDA call (an idle sibling)
 *   memprog capalloc N MIB CHUNK   N times: a relaxed capture begun on a stream and a MIB
 *       cuMemAllocAsync into it (the stub's STUB_CAPTURE_ENDS_AFTER_CHECK ends the capture
 *       between the shim's check and the driver, as another thread may), the capture ended; then
 *       CHUNK allocations until refused
 *   memprog capfree N MIB CHUNK    N times: a MIB cuMemAllocAsync, then its cuMemFreeAsync
 *       captured into a graph that is never launched; then CHUNK allocations until refused
 *   memprog module HOW N MIB CHUNK  N modules or libraries of PTX with a MIB __device__ array
 *       (the stub reads its "global=MIB" comment; HOW data, dataex, fatbin, file: cuModuleLoad*; lib,
 *       libfile: cuLibraryLoad*; libget: cuLibraryLoadData, then cuLibraryGetGlobal, which loads
 *       a lazily loaded library; libmanaged: the same with cuLibraryGetManaged; libattr:
 *       cuLibraryLoadData, then an attribute of its kernel on device MEMPROG_ATTR_DEV (0;
 *       cudaFuncGetAttributes' way; 999 when the answer is not that device's); libkernel: cuLibraryLoadData, then a launch of its kernel handle (cudart's way),
 *       each of which loads it), then CHUNK allocations until refused; unloaded, again
 *   memprog loadidle MIB UNLOAD HOLD_S  one module with a MIB __device__ array (UNLOAD 1: then
 *       unloaded), then HOLD_S seconds without any CUDA call (an idle sibling)
 *   memprog relib MIB              with lazy loading: an 8 MiB library loaded, its global asked
 *       for, unloaded; then a MIB one (the stub hands the same handle out again), its global
 *       asked for; then one cuMemGetInfo
 *   memprog maskload MIB           MIB allocated; a thread frees it while cuModuleLoad of a MIB
 *       module reads its file (a FIFO), then MIB allocated again
 *   memprog kernels MIB CHUNK CARDS  with lazy loading: a library with a MIB __device__ array,
 *       its kernel handle launched once with no context current (the driver refuses it), then
 *       on each of CARDS cards' primary context; then CHUNK allocations until refused on the
 *       last card
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef void *CUcontext, *CUstream, *CUgraph, *CUgraphNode, *CUgraphExec;
typedef struct {
    struct { int allocType, handleTypes; struct { int type, id; } location; void *w; unsigned char r[64]; } poolProps;
    const void *accessDescs; size_t accessDescCount; size_t bytesize; CUdeviceptr dptr;
} CUDA_MEM_ALLOC_NODE_PARAMS;

CUresult cuInit(unsigned);
CUresult cuDeviceGet(CUdevice *, int);
CUresult cuDevicePrimaryCtxRetain(CUcontext *, CUdevice);
CUresult cuCtxSetCurrent(CUcontext);
CUresult cuCtxCreate_v2(CUcontext *, unsigned, CUdevice);
CUresult cuGetProcAddress(const char *, void **, int, unsigned long long);
CUresult cuCtxDestroy_v2(CUcontext);
CUresult cuCtxSetLimit(int, size_t);
CUresult cuDeviceGetDevResource(CUdevice, void *, int);
CUresult cuDevResourceGenerateDesc(void **, void *, unsigned);
CUresult cuGreenCtxCreate(void **, void *, CUdevice, unsigned);
CUresult cuGreenCtxDestroy(void *);
CUresult cuMemGetInfo_v2(size_t *, size_t *);
CUresult cuMemAlloc_v2(CUdeviceptr *, size_t);
CUresult cuMemFree_v2(CUdeviceptr);
CUresult cuMemAllocAsync(CUdeviceptr *, size_t, CUstream);
CUresult cuMemFreeAsync(CUdeviceptr, CUstream);
CUresult cuStreamCreate(CUstream *, unsigned);
CUresult cuStreamBeginCapture_v2(CUstream, int);
CUresult cuStreamEndCapture(CUstream, CUgraph *);
CUresult cuGraphCreate(CUgraph *, unsigned);
CUresult cuGraphAddMemAllocNode(CUgraphNode *, CUgraph, const CUgraphNode *, size_t, CUDA_MEM_ALLOC_NODE_PARAMS *);
CUresult cuGraphAddChildGraphNode(CUgraphNode *, CUgraph, const CUgraphNode *, size_t, CUgraph);
CUresult cuGraphInstantiateWithFlags(CUgraphExec *, CUgraph, unsigned long long);
CUresult cuGraphLaunch(CUgraphExec, CUstream);
CUresult cuGraphExecDestroy(CUgraphExec);
CUresult cuCtxSynchronize(void);
CUresult cuModuleLoad(void **, const char *);
CUresult cuModuleLoadData(void **, const void *);
CUresult cuModuleLoadDataEx(void **, const void *, unsigned, int *, void **);
CUresult cuModuleLoadFatBinary(void **, const void *);
CUresult cuModuleUnload(void *);
CUresult cuLibraryLoadData(void **, const void *, int *, void **, unsigned, int *, void **, unsigned);
CUresult cuLibraryLoadFromFile(void **, const char *, int *, void **, unsigned, int *, void **, unsigned);
CUresult cuLibraryUnload(void *);
CUresult cuLibraryGetGlobal(CUdeviceptr *, size_t *, void *, const char *);
CUresult cuLibraryGetKernel(void **, void *, const char *);
CUresult cuLibraryGetManaged(CUdeviceptr *, size_t *, void *, const char *);
CUresult cuKernelGetAttribute(int *, int, void *, CUdevice);
CUresult cuLaunchKernel(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, CUstream,
                        void **, void **);

static CUdevice dev;
static CUcontext primary;

static void setup(void)
{
    CUresult rc = cuInit(0);
    if (!rc) rc = cuDeviceGet(&dev, 0);
    if (rc) { printf("{\"init_rc\": %d}\n", rc); exit(3); }
    if ((rc = cuDevicePrimaryCtxRetain(&primary, dev)) || (rc = cuCtxSetCurrent(primary))) {
        printf("{\"ctx_rc\": %d}\n", rc);
        exit(3);
    }
}

static CUdeviceptr held[1 << 14];
static long nheld;

static long fill(size_t chunk)
{
    long k = 0;
    while (nheld < (1 << 14) && cuMemAlloc_v2(&held[nheld], chunk) == 0)
        nheld++, k++;
    return k;
}

static void unfill(void)
{
    while (nheld > 0)
        cuMemFree_v2(held[--nheld]);
}

/* A graph with one memory node of `bytes` (its address in *dptr), made as `mode` says. */
static CUgraph mem_graph(const char *mode, size_t bytes, CUdeviceptr *dptr)
{
    CUgraph g = NULL;
    CUDA_MEM_ALLOC_NODE_PARAMS p;
    memset(&p, 0, sizeof p);
    p.poolProps.allocType = 1, p.poolProps.location.type = 1, p.poolProps.location.id = dev;
    p.bytesize = bytes;
    CUgraphNode n;
    if (!strcmp(mode, "capture")) {
        CUstream s;
        CUdeviceptr d;
        cuStreamCreate(&s, 1);
        cuStreamBeginCapture_v2(s, 0);
        CUresult rc = cuMemAllocAsync(&d, bytes, s);
        if (rc) printf("{\"capture_alloc_rc\": %d}\n", rc);
        cuStreamEndCapture(s, &g);
        *dptr = d;
        return g;
    } else if (!strcmp(mode, "child")) {
        CUgraph child;
        cuGraphCreate(&child, 0);
        cuGraphAddMemAllocNode(&n, child, NULL, 0, &p);
        cuGraphCreate(&g, 0);
        cuGraphAddChildGraphNode(&n, g, NULL, 0, child);
    } else {
        cuGraphCreate(&g, 0);
        cuGraphAddMemAllocNode(&n, g, NULL, 0, &p);
    }
    *dptr = p.dptr;
    return g;
}

/* The contexts' tail of a JSON line: CHUNK allocations in the primary context until refused
 * ("more"), then, the `made` objects destroyed, again ("after"). */
static void fill_around(size_t chunk, CUresult (*destroy)(void *), void **objs, int made)
{
    cuCtxSetCurrent(primary);
    long more = fill(chunk);
    unfill();
    for (int i = 0; i < made; i++)
        destroy(objs[i]);
    cuCtxSetCurrent(primary);
    long after = fill(chunk);
    printf("], \"more\": %ld, \"after\": %ld}\n", more, after);
}

static void module_image(char *img, size_t n, unsigned long long mib)
{
    snprintf(img, n, "// global=%llu\n.version 7.0\n.target sm_50\n.address_size 64\n"
             ".visible .global .align 8 .b8 g[%llu];\n", mib, mib << 20);
}

/* One module or library of HOW whose image says global=MIB (file: written to a temporary file). */
static CUresult load_one(const char *how, const char *img, const char *file, void **h)
{
    if (!strcmp(how, "data")) return cuModuleLoadData(h, img);
    if (!strcmp(how, "dataex")) return cuModuleLoadDataEx(h, img, 0, NULL, NULL);
    if (!strcmp(how, "fatbin")) return cuModuleLoadFatBinary(h, img);
    if (!strcmp(how, "file")) return cuModuleLoad(h, file);
    if (!strcmp(how, "lib") || !strcmp(how, "libget") || !strcmp(how, "libmanaged")) {
        CUresult rc = cuLibraryLoadData(h, img, NULL, NULL, 0, NULL, NULL, 0);
        CUdeviceptr p;
        size_t n;
        if (rc || !strcmp(how, "lib")) return rc;
        return !strcmp(how, "libget") ? cuLibraryGetGlobal(&p, &n, *h, "g") : cuLibraryGetManaged(&p, &n, *h, "g");
    }
    if (!strcmp(how, "libattr")) {
        void *k = NULL;
        int regs = 0;
        CUresult rc = cuLibraryLoadData(h, img, NULL, NULL, 0, NULL, NULL, 0);
        const char *on = getenv("MEMPROG_ATTR_DEV");
        int dev = on ? atoi(on) : 0;
        if (!rc) rc = cuLibraryGetKernel(&k, *h, "k");
        if (!rc) rc = cuKernelGetAttribute(&regs, 4 /* CU_FUNC_ATTRIBUTE_NUM_REGS */, k, dev);
        return rc || regs == 32 + dev ? rc : 999; /* the stub's answer for that device */
    }
    if (!strcmp(how, "libfile")) return cuLibraryLoadFromFile(h, file, NULL, NULL, 0, NULL, NULL, 0);
    if (!strcmp(how, "libkernel")) { /* cudart's way: the kernel handle launched as a function */
        void *k = NULL;
        CUresult rc = cuLibraryLoadData(h, img, NULL, NULL, 0, NULL, NULL, 0);
        if (!rc) rc = cuLibraryGetKernel(&k, *h, "k");
        if (!rc) rc = cuLaunchKernel(k, 1, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL);
        if (!rc) rc = cuCtxSynchronize();
        return rc;
    }
    return 1;
}

static void modules(const char *how, int n, const char *mib, size_t chunk)
{
    char img[256], file[] = "/tmp/memprog-module-XXXXXX";
    module_image(img, sizeof img, strtoull(mib, NULL, 10));
    int fd = mkstemp(file);
    if (fd < 0 || write(fd, img, strlen(img) + 1) < 0) { printf("{\"file\": -1}\n"); exit(3); }
    close(fd);
    void *h[64];
    int lib = !strncmp(how, "lib", 3), made = 0;
    unsigned long long (*info_calls)(void) = (unsigned long long (*)(void))dlsym(RTLD_DEFAULT, "stubMemInfoCalls");
    unsigned long long calls0 = info_calls ? info_calls() : 0;
    printf("{\"load_rc\": [");
    for (int i = 0; i < n && i < 64; i++) {
        h[made] = NULL;
        CUresult rc = load_one(how, img, file, &h[made]);
        printf("%s%d", i ? ", " : "", rc);
        if (!rc || (h[made] && strcmp(how, "lib") && strcmp(how, "libfile") && !strncmp(how, "lib", 3)))
            made++;
    }
    unlink(file);
    for (int i = 0; i < made && !strcmp(how, "libkernel"); i++) { /* launched again: no first launch */
        void *k = NULL;
        for (int j = 0; j < 50 && !cuLibraryGetKernel(&k, h[i], "k"); j++)
            cuLaunchKernel(k, 1, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL);
    }
    unsigned long long calls = info_calls ? info_calls() - calls0 : 0;
    long more = fill(chunk);
    unfill();
    for (int i = 0; i < made; i++)
        lib ? cuLibraryUnload(h[i]) : cuModuleUnload(h[i]);
    long after = fill(chunk);
    printf("], \"info_calls\": %llu, \"more\": %ld, \"after\": %ld}\n", calls, more, after);
}

static void relib(unsigned long long mib)
{
    char img[256];
    void *l = NULL;
    CUdeviceptr p;
    size_t n;
    module_image(img, sizeof img, 8);
    CUresult a = cuLibraryLoadData(&l, img, NULL, NULL, 0, NULL, NULL, 0);
    CUresult b = a ? a : cuLibraryGetGlobal(&p, &n, l, "g");
    CUresult c = a ? a : cuLibraryUnload(l);
    module_image(img, sizeof img, mib);
    CUresult d = cuLibraryLoadData(&l, img, NULL, NULL, 0, NULL, NULL, 0);
    CUresult e = d ? d : cuLibraryGetGlobal(&p, &n, l, "g");
    printf("{\"first\": [%d, %d, %d], \"second\": [%d, %d]}\n", a, b, c, d, e);
    size_t f = 0, t = 0;
    cuMemGetInfo_v2(&f, &t);
    printf("{\"free\": %zu}\n", f);
}

static void kernels(unsigned long long mib, size_t chunk, int cards)
{
    char img[256];
    void *l = NULL, *k = NULL;
    module_image(img, sizeof img, mib);
    CUresult rc = cuLibraryLoadData(&l, img, NULL, NULL, 0, NULL, NULL, 0);
    if (!rc) rc = cuLibraryGetKernel(&k, l, "k");
    cuCtxSetCurrent(NULL);
    CUresult none = cuLaunchKernel(k, 1, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL);
    printf("{\"load_rc\": %d, \"no_context_rc\": %d, \"launch_rc\": [", rc, none);
    for (int c = 0; c < cards; c++) {
        CUdevice d;
        CUcontext ctx = NULL;
        CUresult r = cuDeviceGet(&d, c);
        if (!r) r = cuDevicePrimaryCtxRetain(&ctx, d);
        if (!r) r = cuCtxSetCurrent(ctx);
        if (!r) r = cuLaunchKernel(k, 1, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL);
        printf("%s%d", c ? ", " : "", r);
    }
    printf("], \"more\": %ld}\n", fill(chunk));
}

static char mask_fifo[64];
static CUdeviceptr mask_held;
static unsigned long long mask_mib;

static void *mask_free(void *arg)
{
    (void)arg;
    cuCtxSetCurrent(primary);
    int fd = open(mask_fifo, O_WRONLY); /* once the driver opened the module file */
    char img[256];
    cuMemFree_v2(mask_held);
    module_image(img, sizeof img, mask_mib);
    if (fd >= 0 && write(fd, img, strlen(img) + 1) < 0)
        perror("write");
    close(fd);
    return NULL;
}

static void maskload(unsigned long long mib)
{
    snprintf(mask_fifo, sizeof mask_fifo, "/tmp/memprog-fifo-%d", (int)getpid());
    unlink(mask_fifo);
    if (mkfifo(mask_fifo, 0600)) { printf("{\"fifo\": -1}\n"); exit(3); }
    mask_mib = mib;
    CUresult a = cuMemAlloc_v2(&mask_held, mib << 20);
    pthread_t t;
    pthread_create(&t, NULL, mask_free, NULL);
    void *m = NULL;
    CUresult l = cuModuleLoad(&m, mask_fifo);
    pthread_join(t, NULL);
    unlink(mask_fifo);
    CUresult again = cuMemAlloc_v2(&mask_held, mib << 20);
    printf("{\"alloc_rc\": %d, \"load_rc\": %d, \"again_rc\": %d}\n", a, l, again);
}

int main(int argc, char **argv)
{
    setvbuf(stdout, NULL, _IOLBF, 0);
    if (argc < 2) { fprintf(stderr, "usage: see the header of memprog.c\n"); return 2; }
    const char *cmd = argv[1];
    setup();
    size_t f = 0, t = 0;
    if (!strcmp(cmd, "graph") && argc >= 5) {
        size_t bytes = strtoull(argv[3], NULL, 0) << 20, chunk = strtoull(argv[4], NULL, 0);
        int keep = argc > 5 && !strcmp(argv[5], "keep");
        CUdeviceptr gp = 0;
        CUgraph g = mem_graph(argv[2], bytes, &gp);
        CUgraphExec e = NULL;
        CUresult inst = cuGraphInstantiateWithFlags(&e, g, 0);
        CUresult l1 = cuGraphLaunch(e, NULL);
        cuCtxSynchronize();
        if (!l1)
            cuMemFree_v2(gp);
        CUresult l2 = cuGraphLaunch(e, NULL);
        cuCtxSynchronize();
        long more = fill(chunk);
        unfill();
        if (!l2 && !keep)
            cuMemFree_v2(gp);
        CUresult des = cuGraphExecDestroy(e);
        long after = fill(chunk);
        printf("{\"inst_rc\": %d, \"launch1_rc\": %d, \"launch2_rc\": %d, \"more\": %ld, \"destroy_rc\": %d, "
               "\"after\": %ld}\n", inst, l1, l2, more, des, after);
        return 0;
    }
    if (!strcmp(cmd, "ctx") && argc >= 4) {
        int n = atoi(argv[2]);
        size_t chunk = strtoull(argv[3], NULL, 0);
        CUcontext c[16];
        int made = 0;
        CUresult (*create)(CUcontext *, unsigned, CUdevice) = cuCtxCreate_v2;
        if (argc > 4 && !strcmp(argv[4], "v1") && cuGetProcAddress("cuCtxCreate", (void **)&create, 3010, 0))
            return 4;
        printf("{\"ctx_rc\": [");
        for (int i = 0; i < n && i < 16; i++) {
            CUresult rc = create(&c[made], 0, dev);
            printf("%s%d", i ? ", " : "", rc);
            if (!rc) made++;
        }
        fill_around(chunk, cuCtxDestroy_v2, c, made);
        return 0;
    }
    if (!strcmp(cmd, "green") && argc >= 4) {
        int n = atoi(argv[2]);
        size_t chunk = strtoull(argv[3], NULL, 0);
        void *g[16], *desc = NULL;
        unsigned char res[1024]; /* CUdevResource: 144 bytes in CUDA 12.4, room for later ones */
        int made = 0;
        CUresult drc = cuDeviceGetDevResource(dev, res, 1); /* CU_DEV_RESOURCE_TYPE_SM */
        if (!drc)
            drc = cuDevResourceGenerateDesc(&desc, res, 1);
        printf("{\"desc_rc\": %d, \"green_rc\": [", drc);
        for (int i = 0; i < n && i < 16 && !drc; i++) {
            CUresult rc = cuGreenCtxCreate(&g[made], desc, dev, 1); /* CU_GREEN_CTX_DEFAULT_STREAM */
            printf("%s%d", i ? ", " : "", rc);
            if (!rc) made++;
        }
        fill_around(chunk, cuGreenCtxDestroy, g, made);
        return 0;
    }
    if (!strcmp(cmd, "limit") && argc >= 5) {
        CUresult rc = cuCtxSetLimit(atoi(argv[2]), strtoull(argv[3], NULL, 0));
        long more = fill(strtoull(argv[4], NULL, 0));
        cuMemGetInfo_v2(&f, &t);
        printf("{\"limit_rc\": %d, \"more\": %ld, \"free\": %zu}\n", rc, more, f);
        return 0;
    }
    if (!strcmp(cmd, "module") && argc >= 6) {
        modules(argv[2], atoi(argv[3]), argv[4], strtoull(argv[5], NULL, 0));
        return 0;
    }
    if (!strcmp(cmd, "loadidle") && argc >= 5) {
        char img[256];
        void *m = NULL;
        module_image(img, sizeof img, strtoull(argv[2], NULL, 0));
        CUresult l = cuModuleLoadData(&m, img), u = l || !atoi(argv[3]) ? -1 : cuModuleUnload(m);
        printf("{\"load_rc\": %d, \"unload_rc\": %d}\n", l, u);
        usleep((useconds_t)(atof(argv[4]) * 1e6));
        return 0;
    }
    if (!strcmp(cmd, "relib") && argc >= 3) {
        relib(strtoull(argv[2], NULL, 0));
        return 0;
    }
    if (!strcmp(cmd, "kernels") && argc >= 5) {
        kernels(strtoull(argv[2], NULL, 0), strtoull(argv[3], NULL, 0), atoi(argv[4]));
        return 0;
    }
    if (!strcmp(cmd, "maskload") && argc >= 3) {
        maskload(strtoull(argv[2], NULL, 0));
        return 0;
    }
    if (!strcmp(cmd, "hide") && argc >= 4) {
        int (*hidden)(int, long long) = (int (*)(int, long long))dlsym(RTLD_DEFAULT, "stubHidden");
        if (hidden)
            hidden(0, atoll(argv[2]));
        printf("{\"hidden\": %lld}\n", atoll(argv[2]));
        usleep((useconds_t)(atof(argv[3]) * 1e6));
        return 0;
    }
    if ((!strcmp(cmd, "capalloc") || !strcmp(cmd, "capfree")) && argc >= 5) {
        int n = atoi(argv[2]), ok = 0;
        size_t bytes = strtoull(argv[3], NULL, 0) << 20, chunk = strtoull(argv[4], NULL, 0);
        CUstream s;
        CUgraph g;
        cuStreamCreate(&s, 1);
        for (int i = 0; i < n; i++) {
            CUdeviceptr p = 0;
            if (!strcmp(cmd, "capalloc")) {
                cuStreamBeginCapture_v2(s, 2); /* CU_STREAM_CAPTURE_MODE_RELAXED */
                ok += cuMemAllocAsync(&p, bytes, s) == 0;
                cuStreamEndCapture(s, &g);
            } else if (cuMemAllocAsync(&p, bytes, s) == 0) {
                cuCtxSynchronize();
                cuStreamBeginCapture_v2(s, 2);
                ok += cuMemFreeAsync(p, s) == 0;
                cuStreamEndCapture(s, &g); /* the graph, with its free node, is never launched */
            }
        }
        long more = fill(chunk);
        printf("{\"ok\": %d, \"more\": %ld}\n", ok, more);
        return 0;
    }
    if (!strcmp(cmd, "hidden") && argc >= 6) {
        long n = atol(argv[2]), k = 0;
        size_t chunk = strtoull(argv[3], NULL, 0);
        while (k < n && nheld < (1 << 14) && cuMemAlloc_v2(&held[nheld], chunk) == 0)
            nheld++, k++;
        int (*hidden)(int, long long) = (int (*)(int, long long))dlsym(RTLD_DEFAULT, "stubHidden");
        if (hidden)
            hidden(0, atoll(argv[4]));
        printf("{\"n\": %ld}\n", k);
        usleep(250000); /* past the reconciliation interval */
        cuMemGetInfo_v2(&f, &t);
        CUdeviceptr p;
        CUresult rc = cuMemAlloc_v2(&p, chunk);
        printf("{\"alloc_rc\": %d, \"free\": %zu}\n", rc, f);
        if (atof(argv[5]) > 0)
            usleep((useconds_t)(atof(argv[5]) * 1e6));
        return 0;
    }
    fprintf(stderr, "bad command\n");
    return 2;
}
