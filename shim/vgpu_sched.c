/*
 * vgpu_sched.c - the node-wide compute schedule of a card as the shim sees it: the file the
 * node agent writes (<sched dir>/<UUID>.sched, struct vgpu_sched_hdr in vgpu.h), read with
 * POSIX only, and the twin of the agent's window layout kept for the tests that compare them.
 * The gate that uses a window is vgpu_compute.c; the refresh that reads it, vgpu_gate_inputs.c.
 */
#include "vgpu.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

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
                    uint32_t *len_pm, uint32_t *count)
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
    if (count)
        *count = h.count;
    return 0;
}
