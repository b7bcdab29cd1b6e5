"""Stats and Prometheus series as vLLM's metrics API builds them: the lane each prefill was
reached on, where a load's time went (the phase timeline), and the read counters."""

from __future__ import annotations

from types import SimpleNamespace

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from kvshare_connector.transfer.device.records import TransferRecord
from kvshare_connector.vllm.prometheus import KVSharePromMetrics
from kvshare_connector.vllm.stats import KVShareStats


def _registry_types(registry: CollectorRegistry) -> dict[type, type]:
    """prometheus_client's classes, bound to a registry of this test's own."""

    def bound(cls: type) -> type:
        def init(self, *args, **kwargs):
            cls.__init__(self, *args, registry=registry, **kwargs)

        return type(cls.__name__, (cls,), {"__init__": init})

    return {Gauge: bound(Gauge), Counter: bound(Counter), Histogram: bound(Histogram)}


def test_stats_carry_lanes_and_the_load_timeline_to_prometheus():
    stats = KVShareStats()
    timeline = {"asked": 0.0001, "claimed": 0.0009, "posted": 0.001, "landed": 0.00105,
                "reported": 0.0011}  # fmt: skip
    stats.record_read(TransferRecord("r0", 18 << 20, 1, 576, 5e-5, True, 0, 0.002, timeline,
                                     prefill_answer_s=0.0002, claims=2))  # fmt: skip
    stats.record_lane("prefill-0", "cuda_ipc", 812.5, slow=False)
    stats.record_lane("prefill-1", "tcp", 0.5, slow=True)
    other = KVShareStats()
    other.record_read(TransferRecord("r1", 1 << 20, 1, 32, 4e-5, True))
    stats.aggregate(other)  # what vLLM does across workers
    reduced = stats.reduce()
    assert reduced["reads"] == 2 and reduced["slow_lanes"] == 1
    assert reduced["lane GB/s"] == 0.5 and reduced["load p50 ms"] == 1.1

    registry = CollectorRegistry()
    config = SimpleNamespace(kv_transfer_config=None)  # all the base class reads of it
    metrics = KVSharePromMetrics(
        config, _registry_types(registry), ["model_name", "engine"], {0: ["m", "0"]}
    )
    metrics.observe(stats.data, engine_idx=0)
    text = generate_latest(registry).decode()
    assert (
        'vllm:kvshare_lane_probe_gbps{engine="0",lane="cuda_ipc",model_name="m",'
        'peer="prefill-0"} 812.5' in text
    )
    assert 'lane="tcp"' in text
    assert 'vllm:kvshare_slow_lanes_total{engine="0",model_name="m"} 1.0' in text
    for phase in ("asked", "claimed", "posted", "landed", "reported", "prefill_held",
                  "prefill_answer"):
        assert (
            f'vllm:kvshare_load_phase_seconds_count{{engine="0",model_name="m",phase="{phase}"}}'
            " 1.0" in text
        ), phase
    assert 'vllm:kvshare_read_seconds_count{engine="0",model_name="m"} 2.0' in text


def test_prefix_hit_tokens_are_a_prometheus_counter():
    """Decode's scheduler counts, per load, the prompt tokens its own prefix cache held (not
    read) and the tokens the load brought; vLLM sums the engine's steps into one series."""
    stats = KVShareStats()
    stats.count("prefix_hit_tokens", 224)
    stats.count("loaded_tokens", 96)
    step = KVShareStats()
    step.count("prefix_hit_tokens", 1536)
    step.count("loaded_tokens", 512)
    stats.aggregate(step)
    assert not stats.is_empty()
    reduced = stats.reduce()
    assert reduced["prefix_hit_tokens"] == 1760 and reduced["loaded_tokens"] == 608

    registry = CollectorRegistry()
    config = SimpleNamespace(kv_transfer_config=None)
    metrics = KVSharePromMetrics(config, _registry_types(registry), ["engine"], {0: ["0"]})
    metrics.observe(stats.data, engine_idx=0)
    metrics.observe(KVShareStats().data, engine_idx=0)  # a step without loads adds nothing
    text = generate_latest(registry).decode()
    assert 'vllm:kvshare_prefix_hit_tokens_total{engine="0"} 1760.0' in text
    assert 'vllm:kvshare_loaded_tokens_total{engine="0"} 608.0' in text
