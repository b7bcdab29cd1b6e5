"""Transfer stats through vLLM's connector stats API (logged as "KV Transfer metrics")."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from kvshare_connector.transfer.device.records import TransferRecord

_SERIES = ("bytes", "blocks", "descriptors", "seconds")
# refused_*: prefill's side channel refused a message (unauthenticated, garbage, oversize,
# rate-limited, replayed) or a claim (a second reader, blocks not held for the request).
# packed_reads / direct_reads: how decode's reads moved (few large runs, or block by block).
# verified_loads / verify_failures: verify_kv's digests matched prefill's, or did not.
# slow_lanes: lane probes that found a prefill reachable only on a slow lane (tcp emulation).
# refused_peers: decode refused an endpoint that is not the engine the params name, or that
# handed over another engine's NIXL agent. hold_limits: prefill freed a claimed request at
# its claim's bound (its reader never said done). prefix_hit_tokens / loaded_tokens: decode's
# loads, the prompt tokens its own prefix cache held (not read) and the tokens they brought.
COUNTERS = (
    "failed_loads",
    "expired_leases",
    "sent",
    "refused_messages",
    "refused_claims",
    "refused_peers",
    "hold_limits",
    "packed_reads",
    "direct_reads",
    "verified_loads",
    "verify_failures",
    "slow_lanes",
    "prefix_hit_tokens",
    "loaded_tokens",
)
LANES = "lanes"  # lane probes: [prefill engine, lane, GB/s] each
PHASES = "phases"  # per read: {phase: seconds since decode got the order} (records.PHASES)


def empty_data() -> dict[str, Any]:
    return {**{k: [] for k in _SERIES}, LANES: [], PHASES: [], **{k: 0 for k in COUNTERS}}


@dataclass
class KVShareStats(KVConnectorStats):
    """Per-read series (decode) and counters (both roles), aggregated across workers."""

    data: dict[str, Any] = field(default_factory=empty_data)

    def __post_init__(self) -> None:
        for key, value in empty_data().items():
            self.data.setdefault(key, value)

    def record_read(self, record: TransferRecord) -> None:
        values = (record.bytes, record.blocks, record.descriptors, record.seconds)
        for key, value in zip(_SERIES, values, strict=True):
            self.data[key].append(value)
        timeline = dict(record.timeline)
        if record.prefill_held_s is not None:
            timeline["prefill_held"] = record.prefill_held_s
        if record.prefill_answer_s is not None:
            timeline["prefill_answer"] = record.prefill_answer_s
        if timeline:
            self.data[PHASES].append(timeline)

    def record_lane(self, peer: str, lane: str, gbps: float, slow: bool) -> None:
        self.data[LANES].append([peer, lane, round(gbps, 3)])
        if slow:
            self.count("slow_lanes")

    def count(self, counter: str, n: int = 1) -> None:
        self.data[counter] += n

    def reset(self) -> None:
        self.data = empty_data()

    def aggregate(self, other: KVConnectorStats) -> KVShareStats:
        if not other.is_empty():
            for key in (*_SERIES, LANES, PHASES):
                self.data[key].extend(other.data.get(key, []))
            for key in COUNTERS:
                self.data[key] += other.data.get(key, 0)
        return self

    def is_empty(self) -> bool:
        return (
            not self.data["seconds"]
            and not self.data[LANES]
            and not any(self.data[k] for k in COUNTERS)
        )

    def reduce(self) -> dict[str, int | float]:
        seconds = self.data["seconds"]
        total_bytes = sum(self.data["bytes"])
        busy = sum(seconds)
        out: dict[str, int | float] = {
            "reads": len(seconds),
            "MB read": round(total_bytes / 1e6, 3),
            "blocks read": sum(self.data["blocks"]),
            "descriptors": sum(self.data["descriptors"]),
            "read p50 ms": round(statistics.median(seconds) * 1e3, 3) if seconds else 0,
            "read max ms": round(max(seconds) * 1e3, 3) if seconds else 0,
            "GB/s": round(total_bytes / busy / 1e9, 3) if busy else 0,
        }
        out.update({k: self.data[k] for k in COUNTERS})
        if self.data[LANES]:
            out["lane GB/s"] = min(gbps for _, _, gbps in self.data[LANES])
        reported = [t["reported"] for t in self.data[PHASES] if "reported" in t]
        if reported:
            out["load p50 ms"] = round(statistics.median(reported) * 1e3, 3)
        return out
