"""Prometheus series of the connector, through vLLM's connector metrics API.

vLLM calls ``KVShareConnector.build_prom_metrics`` once per API server and feeds every
step's aggregated ``KVShareStats.data`` to ``observe``; the series then appear on
``/metrics`` of ``vllm serve`` next to vLLM's own, labelled per engine.
"""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics
from vllm.v1.metrics.utils import create_metric_per_engine

from kvshare_connector.vllm.stats import COUNTERS, LANES, PHASES

_SECONDS_BUCKETS = [5e-5, 1e-4, 2e-4, 5e-4, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                    1.0, 5.0]  # fmt: skip
_BYTES_BUCKETS = [2 ** (14 + 2 * i) for i in range(10)]  # 16 KiB .. 4 GiB
_DESCRIPTOR_BUCKETS = [1, 2, 4, 8, 16, 64, 256, 1024, 4096, 16384, 65536]

_HISTOGRAMS = {  # stats series -> (metric name, help, buckets)
    "seconds": (
        "vllm:kvshare_read_seconds",
        "Time of one KV read, posted to done.",
        _SECONDS_BUCKETS,
    ),
    "bytes": ("vllm:kvshare_read_bytes", "Bytes of one KV read.", _BYTES_BUCKETS),
    "descriptors": (
        "vllm:kvshare_read_descriptors",
        "Transport descriptors of one KV read (fewer, larger ones move faster).",
        _DESCRIPTOR_BUCKETS,
    ),
}
_COUNTER_HELP = {
    "failed_loads": "Requests whose KV could not be loaded (computed locally instead).",
    "expired_leases": "Prefill requests freed because decode never read them.",
    "sent": "Prefill requests whose KV decode has (read, or stored for it).",
    "refused_messages": "Side-channel messages refused (unauthenticated, garbage, oversize).",
    "refused_claims": "Claims refused (a second reader, blocks not held for the request).",
    "refused_peers": "Prefill endpoints refused: another engine, or another engine's agent.",
    "hold_limits": "Claimed requests freed at the claim's bound (the reader never finished).",
    "packed_reads": "Reads that moved the request packed (few large descriptors).",
    "direct_reads": "Reads that moved block by block (no staging room, or packing off).",
    "verified_loads": "Loads whose KV digests matched prefill's (verify_kv).",
    "verify_failures": "Loads whose KV differed from prefill's (verify_kv): computed locally.",
    "slow_lanes": "Lane probes that found a prefill reachable only on a slow lane.",
    "prefix_hit_tokens": "Prompt tokens of decode's loads its own prefix cache held: not read.",
    "loaded_tokens": "Prompt tokens decode's loads brought from prefill.",
}


class KVSharePromMetrics(KVConnectorPromMetrics):
    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.histograms = {
            key: create_metric_per_engine(
                self._histogram_cls(
                    name=name, documentation=doc, buckets=buckets, labelnames=labelnames
                ),
                per_engine_labelvalues,
            )
            for key, (name, doc, buckets) in _HISTOGRAMS.items()
        }
        self.counters = {
            key: create_metric_per_engine(
                self._counter_cls(
                    name=f"vllm:kvshare_{key}",
                    documentation=_COUNTER_HELP.get(key, key),
                    labelnames=labelnames,
                ),
                per_engine_labelvalues,
            )
            for key in COUNTERS
        }
        # One series per prefill and lane: the probe's GB/s (labels beyond the engine's).
        self._engine_labels = per_engine_labelvalues
        self.phases = self._histogram_cls(
            name="vllm:kvshare_load_phase_seconds",
            documentation="Where a KV load's time goes: seconds from decode's load order to "
            "each phase (asked, claimed, posted, arrived, launched, landed, verified, reported); "
            "prefill_held: how long prefill held the request before decode's claim came; "
            "prefill_answer: how long prefill took to answer the claim.",
            buckets=_SECONDS_BUCKETS,
            labelnames=[*labelnames, "phase"],
        )
        self.lane_gbps = self._gauge_cls(
            name="vllm:kvshare_lane_probe_gbps",
            documentation="GB/s of the lane probe READ from each prefill, labelled by the "
            "transport that carried its bytes (tcp, rdma, cuda_ipc, shm/cma).",
            labelnames=[*labelnames, "peer", "lane"],
            multiprocess_mode="mostrecent",
        )

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for key, per_engine in self.histograms.items():
            for value in transfer_stats_data.get(key, ()):
                per_engine[engine_idx].observe(value)
        for key, per_engine in self.counters.items():
            if n := transfer_stats_data.get(key, 0):
                per_engine[engine_idx].inc(n)
        labels = self._engine_labels.get(engine_idx, [])
        for peer, lane, gbps in transfer_stats_data.get(LANES, ()):
            self.lane_gbps.labels(*labels, peer, lane).set(gbps)
        for timeline in transfer_stats_data.get(PHASES, ()):
            for phase, seconds in timeline.items():
                self.phases.labels(*labels, phase).observe(seconds)
