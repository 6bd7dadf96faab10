/* A tenant that reaches the driver around the shim: it takes glibc's own dlsym from libc.so.6 with
 * dlvsym and looks the driver's functions up in libcuda.so.1 with it, so its
 * allocations never pass the shim's wrappers. Any program can do this, or walk libcuda's symbol
 * table itself; the shim cannot stop a process from calling code in its own address space, which is
 * what the agent's backstop is for (docs/security.md). Used by bench/gpu/realnode_backstop.py;
 * built on the GPU machine by bench/gpu/realnode.sh:
 *
 *     gcc -O2 -o escape_direct bench/gpu/escape_direct.c -ldl
 *     escape_direct TARGET_MIB HOLD_S
 *
 * Allocates TARGET_MIB in 128 MiB blocks (cuMemAlloc_v2) on device 0's primary context and holds
 * them HOLD_S seconds. Output as bench/gpu/escape_zero.py: one JSON line per block
 * ({"mib": N, "t": unix seconds}, "error" when refused), {"done": true, ...} at the end.
 * Exit 2 if the driver cannot be loaded or initialised (that is no escape). */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/time.h>
#include <time.h>

typedef void *(*dlsym_t)(void *, const char *);
typedef int (*cu_init_t)(unsigned);
typedef int (*cu_device_get_t)(int *, int);
typedef int (*cu_primary_retain_t)(void **, int);
typedef int (*cu_ctx_set_t)(void *);
typedef int (*cu_mem_alloc_t)(unsigned long long *, size_t);

static double now(void)
{
    struct timeval tv;
    gettimeofday(&tv, NULL);
    return tv.tv_sec + tv.tv_usec / 1e6;
}

static void *open_driver(void)
{
    /* the name first (LD_LIBRARY_PATH, ld.so.cache), then the folders the driver is mounted at
     * by kvgpu and by distributions */
    static const char *const names[] = {
        "libcuda.so.1", "/usr/local/nvidia/lib64/libcuda.so.1", "/usr/local/nvidia/lib/libcuda.so.1",
        "/usr/lib/x86_64-linux-gnu/libcuda.so.1", "/usr/lib64/libcuda.so.1", NULL};
    for (int i = 0; names[i]; i++) {
        void *h = dlopen(names[i], RTLD_NOW | RTLD_LOCAL);
        if (h)
            return h;
        fprintf(stderr, "dlopen %s: %s\n", names[i], dlerror());
    }
    return NULL;
}

int main(int argc, char **argv)
{
    if (argc != 3) {
        fprintf(stderr, "usage: %s TARGET_MIB HOLD_S\n", argv[0]);
        return 64;
    }
    long target = atol(argv[1]), hold = atol(argv[2]);
    /* asked of libc itself: by default scope a preloaded unversioned dlsym would answer */
    void *libc = dlopen("libc.so.6", RTLD_NOW | RTLD_NOLOAD);
    dlsym_t real_dlsym = libc ? (dlsym_t)dlvsym(libc, "dlsym", "GLIBC_2.34") : NULL;
    if (libc && !real_dlsym)
        real_dlsym = (dlsym_t)dlvsym(libc, "dlsym", "GLIBC_2.2.5");
    void *cuda = open_driver();
    if (!cuda || !real_dlsym)
        return 2;
    cu_init_t init = (cu_init_t)real_dlsym(cuda, "cuInit");
    cu_device_get_t dev_get = (cu_device_get_t)real_dlsym(cuda, "cuDeviceGet");
    cu_primary_retain_t retain = (cu_primary_retain_t)real_dlsym(cuda, "cuDevicePrimaryCtxRetain");
    cu_ctx_set_t set = (cu_ctx_set_t)real_dlsym(cuda, "cuCtxSetCurrent");
    cu_mem_alloc_t alloc = (cu_mem_alloc_t)real_dlsym(cuda, "cuMemAlloc_v2");
    int dev = 0, rc;
    void *ctx = NULL;
    if (!init || !dev_get || !retain || !set || !alloc || (rc = init(0)) != 0 || (rc = dev_get(&dev, 0)) != 0 ||
        (rc = retain(&ctx, dev)) != 0 || (rc = set(ctx)) != 0) {
        fprintf(stderr, "the driver could not be initialised\n");
        return 2;
    }
    long mib = 0;
    while (mib < target) {
        unsigned long long ptr = 0;
        rc = alloc(&ptr, (size_t)128 << 20);
        if (rc != 0) {
            printf("{\"mib\": %ld, \"t\": %.2f, \"error\": \"cuMemAlloc_v2: CUresult %d\"}\n", mib, now(), rc);
            fflush(stdout);
            break;
        }
        mib += 128;
        printf("{\"mib\": %ld, \"t\": %.2f}\n", mib, now());
        fflush(stdout);
    }
    struct timespec ts = {hold, 0};
    while (nanosleep(&ts, &ts) != 0)
        ;
    printf("{\"done\": true, \"mib\": %ld, \"t\": %.2f}\n", mib, now());
    return 0;
}
