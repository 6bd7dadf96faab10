/*
 * vgpu_pycore.c - flat helpers for the cffi test module only (not in libvgpu.so).
 */
#include "vgpu.h"

#include <string.h>

struct envblock { const char *p; };

/* envblock: "KEY=VALUE\0KEY=VALUE\0\0" */
static const char *block_get(const char *name, void *ctx)
{
    const char *p = ((struct envblock *)ctx)->p;
    size_t n = strlen(name);
    while (p && *p) {
        if (strncmp(p, name, n) == 0 && p[n] == '=')
            return p + n + 1;
        p += strlen(p) + 1;
    }
    return NULL;
}

void vgpu_py_config_load(struct vgpu_config *cfg, const char *envblock)
{
    struct envblock b = {envblock};
    vgpu_config_load(cfg, block_get, &b);
}

size_t vgpu_py_region_size(void)
{
    return sizeof(struct vgpu_region);
}
