/*
 * vgpu_config.c - the shim's input: the KVGPU_CLAIM v1 string and HAMi-core's env contract.
 *
 * Pure: no CUDA, no NVML, no global state. The grammar is the one of
 * operator/kvgpu/core/claimstr.py (the property tests in tests/shim/test_claim.py feed the
 * same strings to both and compare):
 *
 *   v1;claim=<ns>/<name>;priority=<0|1>;dev=<UUID>,<memory MiB>,<cores %>[;dev=...][;mode=mps]
 *
 * Precedence (first that is present wins; "present" = the variable is set, even empty):
 *   the container's claim file /etc/kvgpu/claim exists -> the claim from that file only; every
 *                                 claim, HAMi, disable and region/schedule variable is ignored
 *                                 (a process of the container can set those, not the file)
 *   the claims volume /etc/kvgpu mounted but no claim variable -> broken (env -u cannot escape)
 *   CUDA_DISABLE_CONTROL=true  -> shim inert, but only when no kvgpu claim is present
 *                                 (KVGPU_CLAIM / KVGPU_CLAIM_FILE): an image's ENV must not lift
 *                                 limits the operator granted; likewise
 *                                 GPU_CORE_UTILIZATION_POLICY=disable is ignored under a claim
 *   KVGPU_CLAIM_FILE (file exists) -> claim string from the file
 *   KVGPU_CLAIM                -> claim string from the env
 *   CUDA_DEVICE_MEMORY_LIMIT[_i] / CUDA_DEVICE_SM_LIMIT[_i] -> HAMi-core index mode
 *   nothing                    -> no limits (pass-through)
 * A present but invalid claim or HAMi value sets cfg->broken: the shim then refuses to
 * initialise CUDA (fail closed) instead of running unlimited.
 */
#include "vgpu.h"

#include <ctype.h>
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

static int fail(struct vgpu_config *cfg, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(cfg->error, sizeof cfg->error, fmt, ap);
    va_end(ap);
    return -1;
}

/* Python's str.strip() on ASCII: whitespace is \t\n\v\f\r, space and \x1c-\x1f. */
static int is_py_space(unsigned char c)
{
    return c == ' ' || (c >= '\t' && c <= '\r') || (c >= 0x1c && c <= 0x1f);
}

/* Python's re `$` also matches before one final "\n": mirror it so that both parsers accept
 * the same strings (the regex-checked parts keep that "\n" as Python does). */
static size_t re_len(const char *s, size_t n)
{
    return (n > 0 && s[n - 1] == '\n') ? n - 1 : n;
}

/* [a-z0-9]([-a-z0-9.]*[a-z0-9])? */
static int dns_part(const char *s, size_t n)
{
    if (n == 0)
        return 0;
    for (size_t i = 0; i < n; i++) {
        char c = s[i];
        int alnum = (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9');
        if (!alnum && !((c == '-' || c == '.') && i > 0 && i < n - 1))
            return 0;
    }
    return 1;
}

static int claim_ok(const char *s, size_t n)
{
    n = re_len(s, n);
    const char *slash = memchr(s, '/', n);
    if (!slash)
        return 0;
    size_t a = (size_t)(slash - s);
    return dns_part(s, a) && dns_part(slash + 1, n - a - 1);
}

/* (GPU|MIG)-[0-9A-Za-z-]{1,80} */
static int uuid_ok(const char *s, size_t n)
{
    n = re_len(s, n);
    if (n < 5 || (strncmp(s, "GPU-", 4) != 0 && strncmp(s, "MIG-", 4) != 0) || n - 4 > 80)
        return 0;
    for (size_t i = 4; i < n; i++)
        if (!((s[i] >= '0' && s[i] <= '9') || (s[i] >= 'a' && s[i] <= 'z') ||
              (s[i] >= 'A' && s[i] <= 'Z') || s[i] == '-'))
            return 0;
    return 1;
}

/* Non-empty ASCII digits -> value, saturating at UINT64_MAX/10. */
static int digits(const char *s, size_t n, uint64_t *out)
{
    uint64_t v = 0;
    if (n == 0)
        return 0;
    for (size_t i = 0; i < n; i++) {
        if (s[i] < '0' || s[i] > '9')
            return 0;
        if (v < UINT64_MAX / 100)
            v = v * 10 + (uint64_t)(s[i] - '0');
    }
    *out = v;
    return 1;
}

static int parse_dev(struct vgpu_config *cfg, const char *v, size_t n)
{
    const char *c1 = memchr(v, ',', n);
    const char *c2 = c1 ? memchr(c1 + 1, ',', n - (size_t)(c1 + 1 - v)) : NULL;
    if (!c1 || !c2 || memchr(c2 + 1, ',', n - (size_t)(c2 + 1 - v)))
        return fail(cfg, "dev=%.*s must be <UUID>,<memory MiB>,<cores>", (int)n, v);
    size_t ul = (size_t)(c1 - v);
    if (!uuid_ok(v, ul))
        return fail(cfg, "dev=%.*s must be <UUID>,<memory MiB>,<cores>", (int)n, v);
    uint64_t mem, cores;
    if (!digits(c1 + 1, (size_t)(c2 - c1 - 1), &mem) ||
        !digits(c2 + 1, n - (size_t)(c2 + 1 - v), &cores))
        return fail(cfg, "dev=%.*s: memory and cores must be non-negative integers", (int)n, v);
    if (mem < 1 || mem > (1ull << 30) || cores > 100)
        return fail(cfg, "dev=%.*s: memory 1..2^30 MiB, cores 0..100", (int)n, v);
    for (int i = 0; i < cfg->ndev; i++)
        if (strlen(cfg->dev[i].uuid) == ul && memcmp(cfg->dev[i].uuid, v, ul) == 0)
            return fail(cfg, "dev %.*s appears twice", (int)ul, v);
    if (cfg->ndev >= VGPU_MAX_DEV)
        return fail(cfg, "more than %d dev= fields", VGPU_MAX_DEV);
    struct vgpu_dev_cfg *d = &cfg->dev[cfg->ndev++];
    memcpy(d->uuid, v, ul);
    d->uuid[ul] = 0;
    d->mem_limit = mem * VGPU_MIB;
    d->cores = (int)cores;
    return 0;
}

int vgpu_claim_parse(const char *text, struct vgpu_config *cfg)
{
    size_t n = strlen(text);
    const char *s = text;
    while (n && is_py_space((unsigned char)*s))
        s++, n--;
    while (n && is_py_space((unsigned char)s[n - 1]))
        n--;
    cfg->ndev = 0;
    cfg->claim[0] = 0;
    cfg->priority = 1;
    cfg->mps = 0;
    int mode_seen = 0;
    const char *end = s + n;
    const char *semi = memchr(s, ';', n);
    const char *f_end = semi ? semi : end;
    if (f_end - s != 2 || memcmp(s, "v1", 2) != 0)
        return fail(cfg, "claim string must start with 'v1;', got '%.20s'", s);
    const char *f = semi ? semi + 1 : NULL;
    while (f) {
        const char *next = memchr(f, ';', (size_t)(end - f));
        size_t fl = (size_t)((next ? next : end) - f);
        const char *eq = memchr(f, '=', fl);
        if (!eq)
            return fail(cfg, "field '%.*s' is not key=value", (int)fl, f);
        size_t kl = (size_t)(eq - f);
        const char *v = eq + 1;
        size_t vl = fl - kl - 1;
        if (kl == 5 && memcmp(f, "claim", 5) == 0) {
            if (!claim_ok(v, vl) || vl >= sizeof cfg->claim)
                return fail(cfg, "claim=%.*s is not <namespace>/<name>", (int)vl, v);
            memcpy(cfg->claim, v, vl);
            cfg->claim[vl] = 0;
        } else if (kl == 8 && memcmp(f, "priority", 8) == 0) {
            if (vl != 1 || (v[0] != '0' && v[0] != '1'))
                return fail(cfg, "priority=%.*s must be 0 or 1", (int)vl, v);
            cfg->priority = v[0] - '0';
        } else if (kl == 3 && memcmp(f, "dev", 3) == 0) {
            if (parse_dev(cfg, v, vl) != 0)
                return -1;
        } else if (kl == 4 && memcmp(f, "mode", 4) == 0) {
            if (mode_seen++)
                return fail(cfg, "mode appears twice");
            if (vl == 3 && memcmp(v, "mps", 3) == 0)
                cfg->mps = 1;
            else if (!(vl == 9 && memcmp(v, "hami-core", 9) == 0))
                return fail(cfg, "mode=%.*s must be one of hami-core, mps", (int)vl, v);
        } else {
            return fail(cfg, "unknown field '%.*s'", (int)kl, f);
        }
        f = next ? next + 1 : NULL;
    }
    if (cfg->ndev == 0)
        return fail(cfg, "claim string names no dev=");
    if (!cfg->claim[0])
        return fail(cfg, "claim string has no claim=<namespace>/<name>");
    return 0;
}

int vgpu_parse_mem(const char *text, uint64_t *out)
{
    size_t n = strlen(text);
    uint64_t mult = 1, v;
    while (n && isspace((unsigned char)text[n - 1]))
        n--;
    if (n == 0)
        return -1;
    switch (text[n - 1]) {
    case 'k': case 'K': mult = 1ull << 10; n--; break;
    case 'm': case 'M': mult = 1ull << 20; n--; break;
    case 'g': case 'G': mult = 1ull << 30; n--; break;
    default: break;
    }
    if (!digits(text, n, &v) || v > (UINT64_MAX / mult) / 2)
        return -1;
    *out = v * mult;
    return 0;
}

static int parse_pct(const char *text, int *out)
{
    uint64_t v;
    if (!digits(text, strlen(text), &v))
        return -1;
    *out = (v == 0 || v >= 100) ? 0 : (int)v; /* HAMi: 0 or >=100 = no limit */
    return 0;
}

static int env_true(const char *v)
{
    return v && (!strcasecmp(v, "true") || !strcmp(v, "1") || !strcasecmp(v, "yes"));
}

static int read_file(const char *path, char *buf, size_t n)
{
    FILE *f = fopen(path, "r");
    if (!f)
        return -1;
    size_t got = fread(buf, 1, n - 1, f);
    int err = ferror(f);
    fclose(f);
    if (err || got == n - 1)
        return -2;
    buf[got] = 0;
    return 0;
}

static void load_hami(struct vgpu_config *cfg, vgpu_getenv_fn get, void *ctx)
{
    char name[64];
    const char *all_mem = get("CUDA_DEVICE_MEMORY_LIMIT", ctx);
    const char *all_sm = get("CUDA_DEVICE_SM_LIMIT", ctx);
    uint64_t mem_all = 0;
    int sm_all = 0, any = all_mem || all_sm, top = -1;
    if (all_mem && vgpu_parse_mem(all_mem, &mem_all) != 0) {
        cfg->broken = 1;
        fail(cfg, "CUDA_DEVICE_MEMORY_LIMIT=%.40s is not <N>[k|m|g]", all_mem);
        return;
    }
    if (all_sm && parse_pct(all_sm, &sm_all) != 0) {
        cfg->broken = 1;
        fail(cfg, "CUDA_DEVICE_SM_LIMIT=%.40s is not an integer percent", all_sm);
        return;
    }
    for (int i = 0; i < VGPU_MAX_DEV; i++) {
        struct vgpu_dev_cfg *d = &cfg->dev[i];
        d->uuid[0] = 0;
        d->mem_limit = mem_all;
        d->cores = sm_all;
        snprintf(name, sizeof name, "CUDA_DEVICE_MEMORY_LIMIT_%d", i);
        const char *m = get(name, ctx);
        if (m) {
            any = 1, top = i;
            if (vgpu_parse_mem(m, &d->mem_limit) != 0) {
                cfg->broken = 1;
                fail(cfg, "%s=%.40s is not <N>[k|m|g]", name, m);
                return;
            }
        }
        snprintf(name, sizeof name, "CUDA_DEVICE_SM_LIMIT_%d", i);
        const char *s = get(name, ctx);
        if (s) {
            any = 1, top = i;
            if (parse_pct(s, &d->cores) != 0) {
                cfg->broken = 1;
                fail(cfg, "%s=%.40s is not an integer percent", name, s);
                return;
            }
        }
    }
    if (!any)
        return;
    cfg->source = VGPU_SRC_HAMI;
    /* The unsuffixed values apply to every device; suffixed ones to their index only. */
    cfg->ndev = (all_mem || all_sm) ? VGPU_MAX_DEV : top + 1;
    const char *prio = get("CUDA_TASK_PRIORITY", ctx);
    cfg->priority = (prio && prio[0] == '0' && !prio[1]) ? 0 : 1;
}

/* Both strings equal after Python's strip(): the env copy of the file's claim. */
static int same_claim_text(const char *a, const char *b)
{
    size_t na = strlen(a), nb = strlen(b);
    while (na && is_py_space((unsigned char)*a))
        a++, na--;
    while (na && is_py_space((unsigned char)a[na - 1]))
        na--;
    while (nb && is_py_space((unsigned char)*b))
        b++, nb--;
    while (nb && is_py_space((unsigned char)b[nb - 1]))
        nb--;
    return na == nb && memcmp(a, b, na) == 0;
}

/* Container mode: the claim is the container's read-only file, nothing else. */
static void load_container(struct vgpu_config *cfg, const char *path, vgpu_getenv_fn get, void *ctx)
{
    static char buf[8192]; /* not on the stack; vgpu_config_load runs once (vgpu_init) */
    const char *v;
    cfg->container = 1;
    cfg->source = VGPU_SRC_CLAIM;
    if (cfg->policy == VGPU_POLICY_DISABLE)
        cfg->policy = VGPU_POLICY_DEFAULT;
    const char *rd = get(VGPU_CONTAINER_REGION_KEY, ctx);
    rd = rd && rd[0] ? rd : VGPU_CONTAINER_REGION_DIR;
    snprintf(cfg->region_path, sizeof cfg->region_path, "%s/vgpu.region", rd);
    const char *sd = get(VGPU_CONTAINER_SCHED_KEY, ctx);
    snprintf(cfg->sched_dir, sizeof cfg->sched_dir, "%s", sd ? sd : "");
    if ((v = get("KVGPU_REGION_DIR", ctx)) && strcmp(v, rd) != 0)
        cfg->env_ignored |= 4;
    if ((v = get("KVGPU_CLAIM_FILE", ctx)) && v[0] && strcmp(v, path) != 0)
        cfg->env_ignored |= 2;
    if (read_file(path, buf, sizeof buf) != 0) {
        cfg->broken = 1;
        fail(cfg, "the container's claim file %.200s cannot be read or is too large", path);
        return;
    }
    if ((v = get("KVGPU_CLAIM", ctx)) && !same_claim_text(v, buf))
        cfg->env_ignored |= 1;
    if (vgpu_claim_parse(buf, cfg) != 0)
        cfg->broken = 1;
}

void vgpu_config_load(struct vgpu_config *cfg, vgpu_getenv_fn get, void *ctx)
{
    memset(cfg, 0, sizeof *cfg);
    cfg->priority = 1;
    cfg->log_level = 1;
    cfg->period_ns = 100ull * 1000 * 1000;
    const char *v;
    if ((v = get("KVGPU_LOG_LEVEL", ctx)) && isdigit((unsigned char)v[0]))
        cfg->log_level = vgpu_atoi(v);
    else if ((v = get("LIBCUDA_LOG_LEVEL", ctx)) && isdigit((unsigned char)v[0]))
        cfg->log_level = vgpu_atoi(v) > 0 ? vgpu_atoi(v) - 1 : 0; /* HAMi: 2 = default */
    cfg->oom_killer = (v = get("ACTIVE_OOM_KILLER", ctx)) && env_true(v); /* opt-in, see shim.md */
    if ((v = get("GPU_CORE_UTILIZATION_POLICY", ctx))) {
        if (!strcasecmp(v, "force"))
            cfg->policy = VGPU_POLICY_FORCE;
        else if (!strcasecmp(v, "disable"))
            cfg->policy = VGPU_POLICY_DISABLE;
    }
    if ((v = get("KVGPU_COMPUTE_PERIOD_MS", ctx)) && vgpu_atoi(v) >= 10 && vgpu_atoi(v) <= 10000)
        cfg->period_ns = (uint64_t)vgpu_atoi(v) * 1000000ull;
    if ((v = get("KVGPU_SCHED_DIR", ctx)) && v[0])
        snprintf(cfg->sched_dir, sizeof cfg->sched_dir, "%s", v);
    if ((v = get("KVGPU_REGION_DIR", ctx)) && v[0])
        snprintf(cfg->region_path, sizeof cfg->region_path, "%s/vgpu.region", v);
    else if ((v = get("CUDA_DEVICE_MEMORY_SHARED_CACHE", ctx)) && v[0])
        snprintf(cfg->region_path, sizeof cfg->region_path, "%s", v);
    const char *own = get(VGPU_CONTAINER_CLAIM_KEY, ctx);
    if (own && own[0]) {
        load_container(cfg, own, get, ctx);
        return;
    }
    const char *claim_env = get("KVGPU_CLAIM", ctx), *claim_file = get("KVGPU_CLAIM_FILE", ctx);
    int kvgpu_claim = claim_env != NULL || (claim_file && claim_file[0]);
    if (!kvgpu_claim && get(VGPU_CLAIM_MOUNT_KEY, ctx)) {
        /* A kvgpu container whose process unset its claim variables (env -u ...). */
        cfg->broken = 1;
        fail(cfg, "the kvgpu claims volume %s is mounted but KVGPU_CLAIM and KVGPU_CLAIM_FILE "
                  "are unset", VGPU_CLAIM_MOUNT);
        return;
    }
    if (env_true(get("CUDA_DISABLE_CONTROL", ctx))) {
        if (!kvgpu_claim) {
            cfg->disabled = 1;
            return;
        }
    }
    if (kvgpu_claim && cfg->policy == VGPU_POLICY_DISABLE)
        cfg->policy = VGPU_POLICY_DEFAULT; /* a claim's core limit is not the image's to lift */

    static char buf[8192]; /* not on the stack; vgpu_config_load runs once (vgpu_init) */
    const char *text = NULL;
    const char *file = get("KVGPU_CLAIM_FILE", ctx);
    if (file && file[0]) {
        int rc = read_file(file, buf, sizeof buf);
        if (rc == 0)
            text = buf;
        else if (rc == -2 || !claim_env) {
            /* -1 (missing) with no KVGPU_CLAIM to fall back on: the claim is named but absent. */
            cfg->broken = 1;
            fail(cfg, "claim file %.200s %s", file,
                 rc == -2 ? "cannot be read or is too large" : "does not exist and KVGPU_CLAIM is unset");
            return;
        }
    }
    if (!text)
        text = get("KVGPU_CLAIM", ctx);
    if (text) {
        cfg->source = VGPU_SRC_CLAIM;
        if (vgpu_claim_parse(text, cfg) != 0)
            cfg->broken = 1;
    } else {
        load_hami(cfg, get, ctx);
    }
    if (cfg->source != VGPU_SRC_NONE && !cfg->region_path[0])
        snprintf(cfg->region_path, sizeof cfg->region_path, "/tmp/kvgpu-%s.region",
                 cfg->source == VGPU_SRC_HAMI ? "hami" : "claim");
}
