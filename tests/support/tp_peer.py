"""A prefill engine with tensor parallelism, emulated: TP ranks in one process.

Each rank builds vLLM's own KV memory for its part of the model's KV heads (a TP1 build
with ``num_kv_heads = heads / tp``, what a rank of TP ``tp`` holds), has its own NIXL agent
and serves on ``base_port + rank``, like the connector's per-rank workers. Every rank
holds the same requests in the same block ids (one scheduler) and fills each head with
the pattern of its global head index (``lab.tools.headcheck``). Reports on stdout::

    READY {"name", "tp", "heads", "base_port", "requests": [{"request_id", "seed",
           "kv_transfer_params"}]}    once per engine
    ALL_READY {}
    RELEASED {"name", "rank", "read", "expired"}
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
import uuid
from typing import Any

TOKENS = 200


def emit(prefix: str, payload: Any) -> None:
    from kvshare_connector.common.child_process import report

    report(prefix + " ", payload)


class Engine:
    def __init__(self, spec: dict[str, Any]):
        from kvshare_connector.backends.options import ConnectorOptions
        from kvshare_connector.demo.cpu_stack import build_cpu_stack, topology_of
        from kvshare_connector.demo.parts import requests_block_ids
        from kvshare_connector.toolkit.procs import free_port_run
        from kvshare_connector.transfer.decode.shards import rank_shard
        from kvshare_connector.transfer.device.nixl import NixlTransport
        from kvshare_connector.transfer.prefill.source import KVSource
        from kvshare_connector.transfer.wire.kv_params import kv_transfer_params
        from kvshare_connector.transfer.wire.settings import EngineSettings
        from lab.tools.headcheck import fill_heads

        self.name, tp, heads = spec["name"], spec["tp"], spec["heads"]
        engine_id = f"{self.name}-{uuid.uuid4().hex[:8]}"
        base = free_port_run(tp)  # rank r serves on base + r
        self.sources = []
        requests = None
        for rank in range(tp):
            stack = build_cpu_stack(
                spec["model"], "per_layer", kv_bytes=(48 << 20) * max(heads // tp, 1),
                max_model_len=1024, kv_heads=max(heads // tp, 1),
            )  # fmt: skip
            topology = topology_of(stack)
            shard = rank_shard(topology, tp, rank, heads)
            if requests is None:
                requests = requests_block_ids(topology, TOKENS, spec["requests"], 11)
            for index, ids in enumerate(requests):
                fill_heads(stack.kv_caches, topology, shard, ids, seed=index)
            settings = EngineSettings(
                engine_id, port=base + rank, lease_s=spec.get("lease_s", 900.0)
            )
            progress = ConnectorOptions.parse(None).nixl_progress  # the environment's
            transport = NixlTransport(f"{engine_id}-r{rank}", **progress)
            source = KVSource(topology, transport, settings, shard=shard)
            source.keep = stack  # type: ignore[attr-defined]
            self.sources.append(source)
        described = []
        for index, ids in enumerate(requests or []):
            request_id = f"{self.name}-req-{index}"
            for source in self.sources:
                source.hold(request_id, block_ids=ids)
            params = kv_transfer_params(
                remote_block_ids=ids, remote_engine_id=engine_id, remote_request_id=request_id,
                remote_host="127.0.0.1", remote_port=base, remote_num_tokens=TOKENS, tp_size=tp,
            )  # fmt: skip
            described.append({"request_id": request_id, "seed": index, "params": params})
        emit("READY", {"name": self.name, "tp": tp, "heads": heads, "requests": described})

    def poll(self) -> None:
        for rank, source in enumerate(self.sources):
            read, expired = source.poll()
            if read or expired:
                emit(
                    "RELEASED",
                    {"name": self.name, "rank": rank, "read": sorted(read),
                     "expired": sorted(expired)},
                )  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--engines", required=True)
    engines = [Engine(spec) for spec in json.loads(parser.parse_args().engines)]
    emit("ALL_READY", {})
    closed = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), closed.set()), daemon=True).start()
    while not closed.is_set():
        for engine in engines:
            engine.poll()
        time.sleep(0.005)
    for engine in engines:
        for source in engine.sources:
            source.close()
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)


class TPPeer:
    """The test side: starts the process, collects its lines (bounded waits)."""

    def __init__(self, engines: list[dict[str, Any]]):
        from .transfer_peer import peer_env

        self.process = subprocess.Popen(
            [sys.executable, __file__, "--engines", json.dumps(engines)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env=peer_env(),
        )  # fmt: skip
        self.ready: dict[str, dict[str, Any]] = {}
        self.released: list[dict[str, Any]] = []
        self.all_ready = threading.Event()
        self.stderr: list[str] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._out, daemon=True).start()
        threading.Thread(target=self._err, daemon=True).start()

    def _out(self) -> None:
        from kvshare_connector.common.child_process import report_of

        assert self.process.stdout is not None
        for line in self.process.stdout:
            try:
                found = report_of(line, ("READY ", "RELEASED ", "ALL_READY "))
            except ValueError as exc:  # named in the next failure; later lines still count
                self.stderr = [*self.stderr[-30:], str(exc)]
                continue
            if found is None:
                continue
            kind, body = found
            with self._lock:
                if kind == "READY ":
                    self.ready[body["name"]] = body
                elif kind == "RELEASED ":
                    self.released.append(body)
                else:
                    self.all_ready.set()

    def _err(self) -> None:
        assert self.process.stderr is not None
        for line in self.process.stderr:
            self.stderr = [*self.stderr[-30:], line.rstrip()]

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not self.all_ready.wait(0.5) and self.process.poll() is None:
            if time.monotonic() > deadline:
                break
        if not self.all_ready.is_set():
            tail = "\n".join(self.stderr[-15:])
            raise TimeoutError(f"TP peer not ready in {timeout_s:g} s; stderr:\n{tail}")

    def freed_ranks(self, name: str, request_id: str) -> set[int]:
        with self._lock:
            return {
                e["rank"] for e in self.released if e["name"] == name and request_id in e["read"]
            }

    def state(self) -> str:
        """For a failure message: alive or its exit code, and its last stderr lines."""
        code = self.process.poll()
        tail = "\n".join(self.stderr[-15:])
        return f"peer {'alive' if code is None else f'exited ({code})'}; stderr tail:\n{tail}"

    def close(self) -> None:
        if self.process.stdin is not None:
            self.process.stdin.close()
        try:
            self.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.process.kill()
