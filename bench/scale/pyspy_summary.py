"""Summarise a py-spy ``--format raw`` profile of the operator (``run.py --profile``) into
where its CPU goes: one line per activity, share of the samples that were not idle.

    .venv/bin/python bench/scale/pyspy_summary.py <run-dir>/operator-profile.txt
"""

from __future__ import annotations

import collections
import json
import sys

# (activity, a frame-name prefix that marks it), first match from the leaf's root side wins
ACTIVITIES = [
    ("extender: bind (API calls and ledger)", "Binder."),
    ("extender: filter", "Extender.filter"),
    ("extender: prioritize", "Extender.prioritize"),
    ("extender: /metrics scrape", "Extender.metrics_endpoint"),
    ("admission webhooks (Kopf server + our handlers)", "WebhookServer"),
    ("Kopf watch events: pods", "register.<locals>.pod_event"),
    ("Kopf watch events: claims", "register.<locals>.claim_event"),
    ("Kopf watch events: nodes", "register.<locals>.node_event"),
    ("Kopf watch machinery (streams, queues, diffs)", "process_resource_event"),
    ("Kopf watch machinery (streams, queues, diffs)", "worker"),
    ("Kopf watch machinery (streams, queues, diffs)", "continuous_watch"),
    ("Kopf watch machinery (streams, queues, diffs)", "watch_objs"),
    ("background: flush (pool status, metrics)", "Runtime.flush"),
    ("background: orphan sweep", "Runtime.sweep"),
    ("background: requeue", "Runtime._requeue_loop"),
    ("TLS handshakes (new extender connections)", "_handshake_hook.<locals>.Hooked.do_handshake"),
    ("TLS handshakes (new extender connections)", "SSLObject.do_handshake"),
    ("HTTP/2 server (frames, HPACK, flow control)", "H2Server."),
    ("aiohttp server (request parsing, responses)", "RequestHandler"),
    ("watch events: claims and nodes (ListWatch)", "ListWatch."),
    ("executor threads (aiohttp netrc/proxy lookups)", "_worker"),
]
IDLE = ("EpollSelector.select", "select (selectors.py", "_worker (concurrent", "Condition.wait", "Event.wait")


def summarise(path: str) -> dict[str, float]:
    counts: collections.Counter[str] = collections.Counter()
    busy = 0
    for line in open(path, encoding="utf-8", errors="replace"):
        line = line.rstrip()
        if not line:
            continue
        stack, _, n_text = line.rpartition(" ")
        try:
            n = int(n_text)
        except ValueError:
            continue
        frames = stack.split(";")
        if any(frames[-1].startswith(i) for i in IDLE):
            continue
        busy += n
        names = [f.split(" (")[0].strip() for f in frames]
        for label, prefix in ACTIVITIES:
            if any(name.startswith(prefix) for name in names):
                counts[label] += n
                break
        else:
            counts["other (event loop, GC, logging)"] += n
    return {k: round(100 * v / busy, 1) for k, v in counts.most_common()} | {"_busy_samples": busy}


if __name__ == "__main__":
    print(json.dumps(summarise(sys.argv[1]), indent=1))
