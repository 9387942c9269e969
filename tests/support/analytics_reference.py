"""The analytics figures computed the plain way, in Python, from the generated rows: the tests' reference."""

import math
from collections import Counter, defaultdict
from datetime import datetime, timedelta

FINISHED = ("acked", "dead", "expired")


def floor_hour(value: datetime) -> datetime:
    return value.replace(minute=0, second=0, microsecond=0)


def reference(rows, live_created, since: datetime, until: datetime, top: int = 5) -> dict:
    """{(hour, queue, kind): figures} for whole hours in [since, until); ``live_created``: (queue, kind, created)."""
    stats = defaultdict(
        lambda: {
            "enqueued": 0,
            "acked": 0,
            "dead": 0,
            "expired": 0,
            "retried": 0,
            "wait": [],
            "processing": [],
            "attempts": Counter(),
            "errors": Counter(),
        }
    )
    for row in rows:
        if since <= row.created_at < until:
            stats[(floor_hour(row.created_at), row.queue, row.kind)]["enqueued"] += 1
        if row.outcome not in FINISHED or not since <= row.finished_at < until:
            continue
        stat = stats[(floor_hour(row.finished_at), row.queue, row.kind)]
        stat[row.outcome] += 1
        stat["retried"] += row.attempts > 1
        stat["attempts"][str(row.attempts)] += 1
        if row.outcome in ("acked", "dead") and row.claimed_at is not None:
            stat["wait"].append((row.claimed_at - row.first_available_at).total_seconds())
            stat["processing"].append((row.finished_at - row.claimed_at).total_seconds())
        if row.outcome == "dead":
            stat["errors"][row.error_type] += 1
    for queue, kind, created in live_created:
        if since <= created < until:
            stats[(floor_hour(created), queue, kind)]["enqueued"] += 1
    for stat in stats.values():
        stat["wait"].sort()
        stat["processing"].sort()
        stat["top_errors"] = [list(item) for item in sorted(stat.pop("errors").items(), key=lambda i: (-i[1], i[0]))]
        stat["top_errors"] = stat["top_errors"][:top]
        stat["attempts"] = dict(stat["attempts"])
        stat["throughput"] = (stat["acked"] + stat["dead"] + stat["expired"]) / 3600
    return dict(stats)


def within_rank_error(value: float, ordered: list[float], p: float, accuracy: int) -> bool:
    """Whether ``value`` is a p-quantile of ``ordered`` give or take a rank error of n/accuracy (and 1 ms)."""
    n = len(ordered)
    slack = n / accuracy
    lo = max(0, math.floor(p * n - slack) - 1)
    hi = min(n - 1, math.ceil(p * n + slack))
    return ordered[lo] - 1e-3 <= value <= ordered[hi] + 1e-3


def hours(since: datetime, until: datetime) -> list[datetime]:
    out, hour = [], since
    while hour < until:
        out.append(hour)
        hour += timedelta(hours=1)
    return out
