module kvgpu.io/bench/extender_pools

go 1.22
