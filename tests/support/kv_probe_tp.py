"""``KVProbeConnector`` under tensor parallelism: digests per KV head, one file per rank.

Each TP rank's worker digests every (layer, block) one head at a time and names the
digest by the GLOBAL head index (``layer#h<g>``), so two engines with different TP sizes
compare head by head; records go to ``<out stem>.r<rank>.jsonl`` (the ranks are separate
processes). ``merge_ranks`` joins one request's per-rank records into the record
``kv_probe.compare`` reads.

    --kv-transfer-config '{"kv_connector": "KVProbeTPConnector",
        "kv_connector_module_path": "tests.support.kv_probe_tp", ...}'
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from kvshare_connector.layout.topology import HEAD
from tests.support.kv_probe import KVProbeConnector, _synchronize, request_record


def rank_path(out: str | Path, rank: int) -> Path:
    path = Path(out)
    return path.with_name(f"{path.stem}.r{rank}{path.suffix}")


class KVProbeTPConnector(KVProbeConnector):
    def _shard(self) -> Any:
        from kvshare_connector.transfer.shards import rank_shard

        assert self.worker is not None and self.worker.topology is not None
        c = self.worker.context
        return rank_shard(self.worker.topology, c.tp_size, c.tp_rank, c.model_kv_heads)

    def _write(
        self, side: str, request_id: str, remote_id: str, info: Mapping[str, Any], **fields: Any
    ) -> None:
        """One record with a digest per (layer, global head, block)."""
        assert self.worker is not None and self.worker.topology is not None
        _synchronize(self._views)
        record = head_record(
            self.worker.topology,
            self._shard(),
            self._views,
            self._sharer_views(),
            info["groups"],
            int(info["num_tokens"]),
            side=side,
            request_id=request_id,
            remote_request_id=remote_id,
            **fields,
        )
        self._append(record)

    def _append(self, record: Mapping[str, Any]) -> None:
        assert self._out is not None and self.worker is not None
        with open(rank_path(self._out, self.worker.context.tp_rank), "a") as out:
            out.write(json.dumps(record) + "\n")


def head_record(
    topology: Any,
    shard: Any,
    views: Mapping[str, Any],
    sharer_views: Mapping[str, Any],
    groups: Sequence[Sequence[int]],
    num_tokens: int,
    **fields: Any,
) -> dict[str, Any]:
    """``kv_probe.request_record`` one local head at a time, keyed ``layer#h<global>``."""
    counts = {g.count for g in shard.groups}
    if len(counts) != 1:
        raise ValueError(f"per-head digests need one head count per rank, got {counts}")
    merged: dict[str, Any] | None = None
    for h in range(counts.pop()):
        record = request_record(
            topology,
            {n: _head(v, topology, n, h) for n, v in views.items()},
            {n: _head(v, topology, n, h) for n, v in sharer_views.items()},
            groups,
            num_tokens,
            tp_rank=shard.tp_rank,
            tp_size=shard.tp_size,
            **fields,
        )
        merged = _rename_heads(record, shard, h, merged)
    assert merged is not None
    return merged


def _head(view: Any, topology: Any, name: str, h: int) -> Any:
    owner = topology.owners[topology.resolve(name)]
    return view.narrow(owner.labels.index(HEAD), h, 1)


def _rename_heads(
    record: dict[str, Any], shard: Any, h: int, into: dict[str, Any] | None
) -> dict[str, Any]:
    """``record``'s per-layer entries as ``layer#h<global head>`` (added to ``into``)."""
    groups = record["layer_groups"]
    if into is None:
        empty = {"digests": {}, "token_bytes": {}, "layer_groups": {}, "sharers": {}}
        into = {**record, **empty, "num_sharers": 0, "seconds": 0.0}
    out = into
    for name, digests in record["digests"].items():
        key = f"{name}#h{shard.groups[groups[name]].start + h}"
        out["digests"][key] = digests
        out["token_bytes"][key] = record["token_bytes"][name]
        out["layer_groups"][key] = groups[name]
    for sharer, entry in record["sharers"].items():
        head = shard.groups[groups[entry["target"]]].start + h
        out["sharers"][f"{sharer}#h{head}"] = {
            "target": f"{entry['target']}#h{head}",
            "digests": entry["digests"],
        }
    out["num_sharers"] += record["num_sharers"]
    out["seconds"] += record["seconds"]
    return out


def merge_ranks(records: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """One side's records of one request, from each rank, as one record; a head several
    ranks hold (replicated) keeps the first rank's digests (pass the ranks in the order
    to prefer). ``replica_mismatches``: such heads whose digests differ between ranks."""
    first = records[0]
    out = json.loads(json.dumps(first))
    out["replica_mismatches"] = 0
    for record in records[1:]:
        if record["groups"] != first["groups"] or record["num_tokens"] != first["num_tokens"]:
            raise ValueError("ranks disagree on the request's blocks")
        for key, digests in record["digests"].items():
            if key in out["digests"]:
                out["replica_mismatches"] += out["digests"][key] != digests
                continue
            out["digests"][key] = digests
            out["token_bytes"][key] = record["token_bytes"][key]
            out["layer_groups"][key] = record["layer_groups"][key]
        for key, entry in record["sharers"].items():
            out["sharers"].setdefault(key, entry)
        out["seconds"] = out.get("seconds", 0) + record.get("seconds", 0)
    # sharers no tensor was found for, on any rank, stay counted as missing
    missing = sum(r["num_sharers"] - len(r["sharers"]) for r in records)
    out["num_sharers"] = len(out["sharers"]) + missing
    return out
