/*
 * vgpu_compute.c - the compute limit: a windowed duty cycle on the launch path.
 *
 * Model. Time is cut into periods P (default 100 ms) of CLOCK_MONOTONIC, which every
 * container on the node shares. A container with `cores` percent owns one window of length
 * cores% * P at a fixed offset inside each period; the offsets of the containers on one card
 * come from a node-wide schedule file that only the node agent writes (vgpu_sched_read; the
 * container reports its activity in its own region), so co-tenants' windows do not overlap
 * (time-division, hard cap). Launches pass untouched while
 *   (a) the window is open in time, and
 *   (b) the GPU time already queued in this window, estimated as launches x the measured GPU
 *       ns per launch, is below the window's budget.
 * The first launch that fails either test drains the launching stream (cuStreamSynchronize),
 * measures when the queue really ran dry, turns any overrun into debt that shortens the next
 * windows, and sleeps until the next window opens. The per-launch cost estimate comes from the
 * same drain: (drain time - window start) / launches, when the queue was still busy.
 *
 * So the cost per launch with a limit is one clock read and two relaxed atomic adds; there is
 * no NVML sensor in the loop, no lag, and no dependence on the SM count.
 *
 * Pure: gate arithmetic and schedule layout; the schedule file is read with POSIX only.
 */
#include "vgpu.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

void vgpu_gate_init(struct vgpu_gate *g, int cores, uint64_t period_ns)
{
    memset(g, 0, sizeof *g);
    pthread_mutex_init(&g->mu, NULL);
    g->period_ns = period_ns ? period_ns : 100000000ull;
    g->active = cores > 0 && cores < 100;
    g->len_ns = g->period_ns * (uint64_t)(cores > 0 ? cores : 100) / 100;
    g->shared_win_id = &g->local_win_id;
    g->shared_win_used = &g->local_win_used;
}

int vgpu_gate_fast(struct vgpu_gate *g, uint64_t now)
{
    uint64_t ws = g->win_start;
    if (!ws || now < ws || now - ws >= g->win_budget)
        return 0;
    uint64_t est = g->kernel_ns_est;
    if (!est && now - ws >= (g->win_budget / 8 < 5000000 ? g->win_budget / 8 : 5000000))
        return 0; /* no cost estimate yet: a short probe window (<= 5 ms) measures one */
    if (est && atomic_fetch_add_explicit(g->shared_win_used, est, memory_order_relaxed) >= g->win_budget)
        return 0;
    /* A plain add (no lock prefix): concurrent threads may lose a count, which only makes
     * the next cost estimate slightly high; the budget itself is the atomic above. */
    atomic_store_explicit(&g->win_launches, atomic_load_explicit(&g->win_launches, memory_order_relaxed) + 1,
                          memory_order_relaxed);
    return 1;
}

int vgpu_gate_fast_coarse(struct vgpu_gate *g, uint64_t coarse_now, uint64_t margin)
{
    uint64_t ws = g->win_start, est = g->kernel_ns_est;
    /* The real time lies in [coarse, coarse + margin]: decide only if that whole interval is
     * inside the window (and an estimate exists, so the budget check is by count). */
    if (!ws || !est || coarse_now < ws || coarse_now + margin >= ws + g->win_budget)
        return -1;
    if (atomic_fetch_add_explicit(g->shared_win_used, est, memory_order_relaxed) >= g->win_budget)
        return 0;
    atomic_store_explicit(&g->win_launches, atomic_load_explicit(&g->win_launches, memory_order_relaxed) + 1,
                          memory_order_relaxed);
    return 1;
}

void vgpu_gate_close(struct vgpu_gate *g, uint64_t t_det, uint64_t drained)
{
    uint64_t ws = g->win_start, n = atomic_load(&g->win_launches);
    if (!ws)
        return;
    if (drained < t_det)
        drained = t_det;
    if (n > 0 && drained > ws) {
        uint64_t sample = (drained - ws) / n;
        int busy = drained - t_det > 20000; /* queue still held work: GPU busy since ws */
        if (!g->kernel_ns_est)
            g->kernel_ns_est = sample;
        else if (busy || sample < g->kernel_ns_est)
            g->kernel_ns_est = (g->kernel_ns_est + sample) / 2;
    }
    uint64_t end = ws + g->win_budget;
    uint64_t ref = t_det > end ? t_det : end;
    if (drained > ref)
        g->debt_ns += drained - ref;
    g->last_ws = ws;
    g->last_end = end;
    g->win_start = 0;
}

uint64_t vgpu_gate_plan(struct vgpu_gate *g, uint64_t now)
{
    uint64_t P = g->period_ns, off = g->offset_ns % P, len = g->len_ns ? g->len_ns : 1;
    if (g->last_end && !g->debt_ns && now + len / 50 < g->last_end) {
        /* The budget was counted out but the queue drained early (the estimate was high, or
         * the application paused): use the rest of the same window. */
        g->win_start = now;
        g->win_budget = g->last_end - now;
        g->last_end = 0;
        atomic_store(&g->win_launches, 0);
        atomic_store(g->shared_win_used, 0);
        return 0;
    }
    g->last_end = 0;
    if (!g->last_ws && !g->kernel_ns_est) {
        /* First window of the process: start now, unaligned, so that the probe that
         * measures the per-launch cost sees only its own launches. */
        g->win_start = now;
        g->win_budget = len;
        atomic_store(&g->win_launches, 0);
        atomic_store(g->shared_win_used, 0);
        return 0;
    }
    uint64_t ws = now >= off ? now - (now - off) % P : off;
    if (now >= ws + len)
        ws += P;
    while (g->last_ws && ws <= g->last_ws)
        ws += P;
    while (g->debt_ns >= len) { /* whole windows paid by debt */
        g->debt_ns -= len;
        ws += P;
    }
    g->win_budget = len - g->debt_ns;
    g->debt_ns = 0;
    g->win_start = ws;
    atomic_store(&g->win_launches, 0);
    uint64_t old = atomic_load(g->shared_win_id);
    if (old != ws && atomic_compare_exchange_strong(g->shared_win_id, &old, ws))
        atomic_store(g->shared_win_used, 0);
    return ws > now ? ws - now : 0;
}

void vgpu_sched_layout(const uint32_t *share_pm, const uint32_t *prio, const uint64_t *joined,
                       int n, int self, uint32_t *offset_pm, uint32_t *len_pm)
{
    int order[VGPU_SCHED_MAX];
    uint64_t hi = 0, lo = 0;
    if (n > VGPU_SCHED_MAX)
        n = VGPU_SCHED_MAX;
    for (int i = 0; i < n; i++) {
        order[i] = i;
        if (prio[i] == 0)
            hi += share_pm[i];
        else
            lo += share_pm[i];
    }
    for (int i = 1; i < n; i++) /* insertion sort by (priority, join time, index) */
        for (int j = i; j > 0; j--) {
            int a = order[j - 1], b = order[j];
            int swap = prio[a] > prio[b] || (prio[a] == prio[b] && joined[a] > joined[b]);
            if (!swap)
                break;
            order[j - 1] = b, order[j] = a;
        }
    /* High priority gets its share (scaled only if high alone overcommits); low priority is
     * scaled into what is left. */
    uint64_t hi_num = hi > 1000 ? 1000 : hi, hi_den = hi > 1000 ? hi : 1;
    uint64_t left = 1000 - (hi > 1000 ? 1000 : hi);
    uint64_t lo_num = lo > left ? left : 1, lo_den = lo > left ? lo : 1;
    uint64_t off = 0;
    *offset_pm = 0;
    *len_pm = 0;
    for (int k = 0; k < n; k++) {
        int i = order[k];
        uint64_t len = prio[i] == 0 ? (hi > 1000 ? share_pm[i] * hi_num / hi_den : share_pm[i])
                                    : (lo > left ? share_pm[i] * lo_num / lo_den : share_pm[i]);
        if (i == self) {
            *offset_pm = (uint32_t)off;
            *len_pm = (uint32_t)len;
        }
        off += len;
    }
}

_Static_assert(sizeof(struct vgpu_sched_hdr) == 16, "schedule header layout");
_Static_assert(sizeof(struct vgpu_sched_window) == VGPU_CLAIM_LEN + 8, "schedule entry layout");

static int read_full(int fd, void *buf, size_t n, off_t at)
{
    char *p = buf;
    while (n) {
        ssize_t r = pread(fd, p, n, at);
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0)
            return -1;
        p += r, n -= (size_t)r, at += r;
    }
    return 0;
}

int vgpu_sched_read(const char *dir, const char *uuid, const char *key, uint32_t *offset_pm,
                    uint32_t *len_pm)
{
    char path[700];
    if (!dir || !dir[0] || !uuid || !uuid[0] || strchr(uuid, '/') || !key || !key[0])
        return -1;
    snprintf(path, sizeof path, "%s/%s.sched", dir, uuid);
    /* Read-only, no lock: the agent renames a complete file into place, so an open file is
     * always one whole version. O_NONBLOCK: a FIFO planted here (host mode) cannot hang us. */
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NOCTTY | O_NONBLOCK);
    if (fd < 0)
        return -1;
    struct vgpu_sched_hdr h;
    struct vgpu_sched_window w;
    uint32_t off = 0, len = 0;
    int found = 0, bad = read_full(fd, &h, sizeof h, 0) != 0 || h.magic != VGPU_SCHED_MAGIC ||
                         h.version != VGPU_SCHED_VERSION || h.entry_size != sizeof w ||
                         h.count > VGPU_SCHED_MAX;
    /* The whole file is checked: a short or garbled one is trusted in none of its entries. */
    for (uint32_t i = 0; !bad && i < h.count; i++) {
        bad = read_full(fd, &w, sizeof w, (off_t)(sizeof h + (size_t)i * sizeof w)) != 0 ||
              memchr(w.key, 0, sizeof w.key) == NULL || w.offset_pm > 1000 || w.len_pm > 1000 ||
              w.offset_pm + w.len_pm > 1000;
        if (!bad && !found && strcmp(w.key, key) == 0)
            found = 1, off = w.offset_pm, len = w.len_pm;
    }
    close(fd);
    if (bad || !found)
        return -1;
    *offset_pm = off;
    *len_pm = len;
    return 0;
}
