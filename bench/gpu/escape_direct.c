/* A tenant that reaches the driver around the shim: it takes glibc's own dlsym from libc.so.6 with
 * dlvsym and looks the driver's functions up in libcuda.so.1 with it, so its
 * allocations never pass the shim's wrappers. Any program can do this, or walk libcuda's symbol
 * table itself; the shim cannot stop a process from calling code in its own address space, which is
 * what the agent's backstop is for (docs/security.md). Used by bench/gpu/realnode_backstop.py;
 * built on the GPU machine by bench/gpu/realnode.sh:
 *
 *     gcc -O2 -o escape_direct bench/gpu/escape_direct.c -ldl
 *     escape_direct TARGET_MIB HOLD_S
 *     escape_direct spin SECONDS
 *
 * Allocates TARGET_MIB in 128 MiB blocks (cuMemAlloc_v2) on device 0's primary context and holds
 * them HOLD_S seconds. Output as bench/gpu/escape_zero.py: one JSON line per block
 * ({"mib": N, "t": unix seconds}, "error" when refused), {"done": true, ...} at the end.
 * `spin` keeps every SM busy for SECONDS instead (a PTX kernel that spins ~1 ms on its clock,
 * 1024 blocks a launch, launched back to back): one JSON line a second ({"launches": N, "t": ...}).
 * It initialises CUDA and its context through the shim first (the dlsym everyone uses), so the
 * shim attaches it to its container's region and it looks enforced, then launches around it.
 * Exit 2 if the driver cannot be loaded or initialised (that is no escape). */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/time.h>
#include <time.h>

typedef void *(*dlsym_t)(void *, const char *);
typedef int (*cu_init_t)(unsigned);
typedef int (*cu_device_get_t)(int *, int);
typedef int (*cu_primary_retain_t)(void **, int);
typedef int (*cu_ctx_set_t)(void *);
typedef int (*cu_mem_alloc_t)(unsigned long long *, size_t);
typedef int (*cu_module_load_t)(void **, const void *);
typedef int (*cu_module_fn_t)(void **, void *, const char *);
typedef int (*cu_launch_t)(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, void *,
                           void **, void **);
typedef int (*cu_sync_t)(void);

/* spin(cycles): each thread waits until its SM clock has advanced by `cycles` */
static const char spin_ptx[] =
    ".version 7.0\n.target sm_70\n.address_size 64\n"
    ".visible .entry spin(.param .u64 cycles)\n{\n"
    "  .reg .pred %p<2>;\n  .reg .b64 %rd<5>;\n"
    "  ld.param.u64 %rd1, [cycles];\n  mov.u64 %rd2, %clock64;\n"
    "LOOP:\n  mov.u64 %rd3, %clock64;\n  sub.s64 %rd4, %rd3, %rd2;\n"
    "  setp.lt.u64 %p1, %rd4, %rd1;\n  @%p1 bra LOOP;\n  ret;\n}\n";

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

static int spin(void *cuda, dlsym_t real_dlsym, long seconds)
{
    cu_module_load_t load = (cu_module_load_t)real_dlsym(cuda, "cuModuleLoadData");
    cu_module_fn_t get = (cu_module_fn_t)real_dlsym(cuda, "cuModuleGetFunction");
    cu_launch_t launch = (cu_launch_t)real_dlsym(cuda, "cuLaunchKernel");
    cu_sync_t sync = (cu_sync_t)real_dlsym(cuda, "cuCtxSynchronize");
    void *mod = NULL, *fn = NULL;
    int rc;
    if (!load || !get || !launch || !sync || (rc = load(&mod, spin_ptx)) != 0 || (rc = get(&fn, mod, "spin")) != 0) {
        fprintf(stderr, "the spin kernel could not be loaded\n");
        return 2;
    }
    unsigned long long cycles = 2000000, launches = 0;
    void *params[] = {&cycles};
    double end = now() + seconds, next = now() + 1;
    while (now() < end) {
        for (int i = 0; i < 20; i++, launches++)
            if ((rc = launch(fn, 1024, 1, 1, 128, 1, 1, 0, NULL, params, NULL)) != 0) {
                printf("{\"launches\": %llu, \"t\": %.2f, \"error\": \"cuLaunchKernel: CUresult %d\"}\n", launches,
                       now(), rc);
                return 1;
            }
        sync();
        if (now() >= next) {
            printf("{\"launches\": %llu, \"t\": %.2f}\n", launches, now());
            fflush(stdout);
            next += 1;
        }
    }
    printf("{\"done\": true, \"launches\": %llu, \"t\": %.2f}\n", launches, now());
    return 0;
}

int main(int argc, char **argv)
{
    if (argc != 3) {
        fprintf(stderr, "usage: %s TARGET_MIB HOLD_S | %s spin SECONDS\n", argv[0], argv[0]);
        return 64;
    }
    int spinning = strcmp(argv[1], "spin") == 0;
    long target = spinning ? 0 : atol(argv[1]), hold = atol(argv[2]);
    /* asked of libc itself: by default scope a preloaded unversioned dlsym would answer */
    void *libc = dlopen("libc.so.6", RTLD_NOW | RTLD_NOLOAD);
    dlsym_t real_dlsym = libc ? (dlsym_t)dlvsym(libc, "dlsym", "GLIBC_2.34") : NULL;
    if (libc && !real_dlsym)
        real_dlsym = (dlsym_t)dlvsym(libc, "dlsym", "GLIBC_2.2.5");
    void *cuda = open_driver();
    if (!cuda || !real_dlsym)
        return 2;
    dlsym_t setup = spinning ? dlsym : real_dlsym;
    cu_init_t init = (cu_init_t)setup(cuda, "cuInit");
    cu_device_get_t dev_get = (cu_device_get_t)setup(cuda, "cuDeviceGet");
    cu_primary_retain_t retain = (cu_primary_retain_t)setup(cuda, "cuDevicePrimaryCtxRetain");
    cu_ctx_set_t set = (cu_ctx_set_t)setup(cuda, "cuCtxSetCurrent");
    cu_mem_alloc_t alloc = (cu_mem_alloc_t)real_dlsym(cuda, "cuMemAlloc_v2");
    int dev = 0, rc;
    void *ctx = NULL;
    if (!init || !dev_get || !retain || !set || !alloc || (rc = init(0)) != 0 || (rc = dev_get(&dev, 0)) != 0 ||
        (rc = retain(&ctx, dev)) != 0 || (rc = set(ctx)) != 0) {
        fprintf(stderr, "the driver could not be initialised\n");
        return 2;
    }
    if (spinning)
        return spin(cuda, real_dlsym, hold);
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
