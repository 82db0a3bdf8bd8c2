"""The one statistics helper of the benchmarks: every p50, p90 and p99 they print is this.

**Definition.** The q-th percentile (q in 0..100) of n values is taken at rank
``(n - 1) * q / 100`` of the sorted values, interpolating linearly between the two closest
ranks: numpy's default, Hyndman and Fan's type 7, ``statistics.quantiles(data, n=100,
method="inclusive")``. So p50 is the median (the mean of the two middle values of an even
sample), p0 the minimum, p100 the maximum, and a percentile of one value is that value.

Before this module the benches had three definitions: this one (cni_bench, scale_bench,
cluster_bench, kube_bench, etcd_claims, etcd_clients, ipam_occupancy); the value at the
nearest rank ``round((n - 1) * q)`` without interpolation (policy_bench,
policy_incremental_bench, policy_cluster_bench, dataplane_bench, bird_bench); and the value
at rank ``int(q * n)`` (routing_bench; call_cost_bench's median ``sorted(v)[n // 2]``, the
upper middle value). The three agree on large samples and differ by up to one rank on small
ones (the p90 of 20 sorted values: the 18th plus a tenth of the way to the 19th; the 18th;
the 19th).

Standard library only, no I/O: ``bench/cni/cni_bench.py`` runs with a bare ``python3``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

__all__ = ["median", "pct", "percentile", "summary"]


def percentile(values: Iterable[float], q: float) -> float | None:
    """The q-th percentile (0..100) of ``values`` as defined above; None when there is none."""
    if not 0 <= q <= 100:
        raise ValueError("q must be within 0..100")
    ordered = sorted(values)
    if not ordered:
        return None
    pos = (len(ordered) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def pct(values: Iterable[float], q: float) -> float:
    """:func:`percentile`, NaN when there is no value (for tables that print NaN as "-")."""
    p = percentile(values, q)
    return math.nan if p is None else p


def median(values: Iterable[float]) -> float | None:
    """p50."""
    return percentile(values, 50)


def summary(values: Iterable[float], qs: Iterable[int] = (50, 90)) -> dict[str, float | int]:
    """``{"n", "p50", "p90", ..., "min", "max"}`` (NaN for each statistic of no value)."""
    ordered = sorted(values)
    out: dict[str, float | int] = {"n": len(ordered)}
    for q in qs:
        out[f"p{q}"] = pct(ordered, q)
    out["min"] = ordered[0] if ordered else math.nan
    out["max"] = ordered[-1] if ordered else math.nan
    return out
