"""A prometheus_client collector over a KVStore's counters.

    from prometheus_client import REGISTRY
    REGISTRY.register(ferry.prometheus.KVCollector(store))

Families follow the C library's text exporter (ferry_kv_*), with a `tier`
label on the per-tier ones and latency histograms in seconds.
"""
from prometheus_client.core import (CounterMetricFamily, GaugeMetricFamily,
                                    HistogramMetricFamily)

_COUNTERS = {
    "lookups": "lookup calls",
    "lookup_tokens": "tokens asked about by lookups",
    "hit_tokens": "tokens lookups found cached",
    "stores": "store calls",
    "stored_chunks": "chunks written",
    "stored_bytes": "bytes written by stores",
    "retrieves": "retrieve calls",
    "retrieved_chunks": "chunks loaded",
    "retrieved_bytes": "bytes loaded",
    "misses": "chunks asked of retrieve and not found",
    "prefetched_chunks": "chunks prefetched",
    "deleted_chunks": "chunks deleted",
    "failures": "calls or chunks that failed",
    "alloc_failures": "stores declined for lack of memory",
    "corrupt_chunks": "chunks that failed their check (each a miss, never bytes)",
}
_TIER_COUNTERS = ("hits", "evictions", "bytes_written", "bytes_read", "failures")
_TIER_GAUGES = ("used_bytes", "capacity_bytes", "chunks", "usage")


class KVCollector:
    def __init__(self, store, prefix="ferry_kv"):
        self.store = store
        self.prefix = prefix

    def collect(self):
        s = self.store.stats()
        p = self.prefix
        for name, doc in _COUNTERS.items():
            c = CounterMetricFamily(f"{p}_{name}", doc)
            c.add_metric([], s[name])
            yield c
        g = GaugeMetricFamily(f"{p}_chunks", "chunks in the index")
        g.add_metric([], s["chunks"])
        yield g
        for f in _TIER_COUNTERS:
            c = CounterMetricFamily(f"{p}_tier_{f}", f"per tier: {f}", labels=["tier"])
            for tier, ts in s["tier"].items():
                c.add_metric([tier], ts[f])
            yield c
        for f in _TIER_GAUGES:
            g = GaugeMetricFamily(f"{p}_tier_{f}", f"per tier: {f}", labels=["tier"])
            for tier, ts in s["tier"].items():
                g.add_metric([tier], ts[f])
            yield g
        for h in ("lookup", "store", "retrieve"):
            yield _histogram(f"{p}_{h}_seconds", f"{h} latency", s[f"{h}_ns"])


def _histogram(name, doc, buckets):
    # bucket b counts latencies in [2^b, 2^(b+1)) ns
    acc, out, total_ns = 0, [], 0.0
    for b, n in enumerate(buckets):
        acc += n
        total_ns += n * 1.5 * (1 << b)  # bucket midpoint: the sum is an estimate
        out.append((repr((1 << (b + 1)) / 1e9), acc))
    out.append(("+Inf", acc))
    h = HistogramMetricFamily(name, doc)
    h.add_metric([], out, total_ns / 1e9)
    return h
