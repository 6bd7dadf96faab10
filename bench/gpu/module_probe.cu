// module_probe.cu - a __device__ array of BIG_MIB MiB in a cudart program: where its memory is
// taken (context start, library load, first launch) and whether the shim charges it. One JSON
// line per step; the free memory is cudaMemGetInfo's (under the shim: the slice's view).
//   nvcc -O2 -arch=sm_90 -cudart shared -DBIG_MIB=1024 -o module_probe bench/gpu/module_probe.cu
#include <cstdio>
#include <cuda_runtime.h>

__device__ char big[(size_t)BIG_MIB << 20];

__global__ void touch(char *o) { o[threadIdx.x] = big[(size_t)threadIdx.x << 16]; }

static size_t free_mib()
{
    size_t f = 0, t = 0;
    cudaMemGetInfo(&f, &t);
    return f >> 20;
}

int main()
{
    cudaError_t e = cudaFree(0);
    printf("{\"init\": %d, \"free_mib\": %zu}\n", e, free_mib());
    char *o = nullptr;
    e = cudaMalloc(&o, 4096);
    touch<<<1, 32>>>(o);
    cudaError_t l = cudaGetLastError(), s = cudaDeviceSynchronize();
    printf("{\"malloc\": %d, \"launch\": %d, \"sync\": %d, \"free_mib\": %zu}\n", e, l, s, free_mib());
    int n = 0;
    void *p;
    while (n < 4096 && cudaMalloc(&p, 64 << 20) == cudaSuccess)
        n++;
    printf("{\"blocks_64mib_after\": %d}\n", n);
    return 0;
}
