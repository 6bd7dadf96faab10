/*
 * vgpu_gate_inputs.c - the compute limiter's gate (vgpu_launch.c) per card: its setup from the
 * claim, and what it reads from outside the process on its slow path: the window the node
 * agent's schedule gives the container (and the activity and busy share the container stamps
 * for the agent in its region), and the card's busy time in NVML's utilization samples for the
 * busy calibration (arithmetic: vgpu_calibrate.c).
 */
#include "vgpu_cuda.h"

#include <time.h>

void vgpu_compute_setup(int d, CUdevice dev)
{
    (void)dev;
    struct vgpu_gate *g = &vgpu.gate[d];
    int cores = vgpu.cfg.policy == VGPU_POLICY_DISABLE ? 0 : (int)vgpu.region.r->dev[d].cores;
    vgpu_gate_init(g, cores, vgpu.cfg.period_ns);
    /* An uncapped high-priority tenant of a coordinated card is measured (never delayed): the
     * agent gives low-priority co-tenants what it leaves. */
    if (!g->active && vgpu.cfg.policy != VGPU_POLICY_DISABLE && vgpu.cfg.priority == 0 &&
        vgpu.cfg.sched_dir[0] && vgpu.cfg.claim[0])
        g->active = g->measure_only = 1;
    if (!vgpu.region.private_map)
        g->vt = &vgpu.region.r->dev[d].credit_vt;
    uint64_t margin = 2 * vgpu_coarse_margin();
    if (g->batch_ns < margin)
        g->batch_ns = margin;
}

/* At most every 500 ms, when a launch is about to wait for credit: the card's busy time in
 * NVML's newest utilization samples against the GPU time measured in their span
 * (vgpu_gate_calibrate; only a process alone on the card is calibrated), or, for processes of a
 * container the schedule lists alone on the card, against the container's share of the span
 * (vgpu_gate_calibrate_container). NVML stamps samples with the wall clock: mapped to the
 * gate's clock. */
void vgpu_gate_calibrate_now(int d, struct vgpu_gate *g, uint64_t now)
{
    unsigned long long from_us = 0;
    uint64_t busy = 0, waited = g->cal_waited_ns;
    int alone = 0;
    unsigned procs = 0;
    g->cal_last_ns = now;
    g->cal_waited_ns = 0;
    /* Only a tenant near its share needs it: one under half of it (a request now and then) pays
     * no NVML call on its launch path. A process of a container alone on the card may use
     * little of the share its siblings spend: it is held back all the same. */
    uint64_t own = vgpu_gate_cal_own(g, now - VGPU_CAL_NS, now);
    int near = own != ~0ull && (unsigned __int128)own * 2 * g->period_ns >= (unsigned __int128)VGPU_CAL_NS * g->len_ns;
    int listed_alone = g->sched_listed && !g->cotenants;
    if (!near && !listed_alone)
        return;
    unsigned long long seen = g->cal_seen_us;
    int got = vgpu_nvml_card_busy(d, &g->cal_seen_us, &from_us, &busy, &alone, &procs);
    if (!alone && !(listed_alone && procs > 1)) {
        vgpu_gate_calibrate(g, 0, 0, 0, 0);
        return;
    }
    if (!seen && g->cal_seen_us) /* the reading only started the cursor: the next one sooner */
        g->cal_last_ns = now - (VGPU_CAL_NS - VGPU_CAL_FIRST_NS);
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    int64_t off = (int64_t)ts.tv_sec * (int64_t)VGPU_SEC + ts.tv_nsec - (int64_t)vgpu_now_ns();
    int64_t t0 = (int64_t)from_us * 1000 - off, t1 = (int64_t)g->cal_seen_us * 1000 - off;
    if (!got || t0 <= 0 || t1 <= t0)
        return;
    if (!alone)
        vgpu_gate_calibrate_container(g, (uint64_t)t0, (uint64_t)t1, busy, procs, waited);
    else if (near)
        vgpu_gate_calibrate(g, (uint64_t)t0, (uint64_t)t1, busy, 1);
    if (vgpu.cfg.log_level >= 3)
        vgpu_log(3, "calibrate d%d: card busy %llu us in %lld us, procs %u alone %d waited %llu us: %u pm",
                 d, (unsigned long long)(busy / 1000), (long long)(t1 - t0) / 1000, procs, alone,
                 (unsigned long long)(waited / 1000), g->cal_pm);
}

/* Every 100 ms on the slow path: stamp the container's activity and busy share in its own
 * region (the agent reads them) and read the window the agent laid out for this card. A
 * missing, short or garbage schedule, or one that does not list us yet: our own share at
 * offset 0, alone (capped, never unlimited); retried on every slow path until listed. A window
 * is never longer than our own share. */
void vgpu_gate_refresh_schedule(int d, uint64_t now)
{
    struct vgpu_gate *g = &vgpu.gate[d];
    struct vgpu_region_dev *rd = &vgpu.region.r->dev[d];
    if (g->last_sched_ns && now - g->last_sched_ns < VGPU_SCHED_REFRESH_NS) {
        if (g->measure_only && vgpu_gate_busy_rise(g, now)) /* low priority must yield now */
            atomic_store_explicit(&rd->sched_busy_pm, g->busy_pm, memory_order_relaxed);
        return;
    }
    uint64_t hb = atomic_load_explicit(&rd->sched_heartbeat_ns, memory_order_relaxed);
    if (!hb || hb > now || now - hb >= VGPU_SCHED_STALE_NS)
        atomic_store_explicit(&rd->sched_joined_ns, now, memory_order_relaxed); /* (re)joins at the end */
    atomic_store_explicit(&rd->sched_heartbeat_ns, now, memory_order_relaxed);
    if (!g->last_sched_ns || now - g->last_sched_ns >= VGPU_SCHED_REFRESH_NS)
        atomic_store_explicit(&rd->sched_busy_pm, vgpu_gate_busy(g, now), memory_order_relaxed);
    if (g->measure_only) {
        g->last_sched_ns = now;
        return;
    }
    uint32_t off = 0, len = 0, n = 0;
    if (vgpu.cfg.sched_dir[0] && vgpu.cfg.claim[0] &&
        vgpu_sched_read(vgpu.cfg.sched_dir, rd->uuid, vgpu.cfg.claim, &off, &len, &n) == 0) {
        uint64_t l = g->base_period_ns * len / 1000;
        g->last_sched_ns = now;
        g->sched_listed = 1;
        vgpu_gate_set_window(g, g->base_period_ns * off / 1000, l < g->share_ns ? l : g->share_ns, n > 1);
        return;
    }
    g->last_sched_ns = vgpu.cfg.sched_dir[0] && vgpu.cfg.claim[0] ? 0 : now;
    g->sched_listed = 0;
    vgpu_gate_set_window(g, 0, g->share_ns, 0);
}
