"""A prefill peer for the transfer tests: several ``KVSource``s in one process.

Starting a process that imports vLLM costs seconds, so one peer serves several sources
(each a model, a layout, its own NIXL agent and side-channel port), each holding several
requests with disjoint block ids and their own pattern seed. It reports on stdout, one
JSON line each::

    READY {"name", "engine_id", "layout", "requests": [{"request_id", "seed",
           "kv_transfer_params"}], ...}          once per source
    ALL_READY {}
    RELEASED {"name", "read", "expired", "held", "after_s"}   whenever a source frees blocks
    BYE {"name": {"held": [...]}, ...}            when stdin closes (then it exits)

    python tests/support/transfer_peer.py --sources '[{"name": "tiny", "model": "g4tiny",
        "layout": "per_layer", "requests": 4, "tokens": 300, "lease_s": 300}]'

Source keys: name, model, layout, requests (1), tokens (300), lease_s (300), kv_mib (64),
max_model_len (2048), seed (100), port (0: any free one), fill ("pattern": ``kvcheck.fill``
per request, or "bytes": every registered byte set to 0x5A, fast enough for big caches),
identity (the ``EngineIdentity`` fields the source states, default none), packed_mib (0),
verify (false: digest held requests for ``verify_kv`` readers), corrupt (request indices
whose first owner block, or first packed bytes, are overwritten after it was held and
digested: the KV changed under prefill), probe_mib (0: a lane probe buffer of this size,
named in the handshake), probe_lie (false: the probe buffer holds another seed's pattern
than the one the handshake names), secret (none: the side channel's shared secret).
"""

from __future__ import annotations

import argparse
import ctypes
import faulthandler
import json
import os
import signal
import sys
import threading
import time
import uuid
from typing import Any

PREFIX_READY = "READY "
PREFIX_ALL_READY = "ALL_READY "
PREFIX_RELEASED = "RELEASED "
PREFIX_BYE = "BYE "


def emit(prefix: str, payload: Any) -> None:
    from kvshare_connector.common.child_process import report

    report(prefix, payload)


def disjoint_requests(topology: Any, tokens: int, count: int, seed: int) -> list[list[list[int]]]:
    """``count`` requests' block ids per group, as a block pool hands them out."""
    from kvshare_connector.demo.parts import requests_block_ids

    return requests_block_ids(topology, tokens, count, seed)


def overwrite_first_block(topology: Any, block_ids: list[list[int]]) -> None:
    """64 bytes of the first owner layer's first block of the request, set to 0x77."""
    name = sorted(topology.owners)[0]
    owner = topology.owners[name]
    block = next(b for b in block_ids[owner.group] if b)
    g = owner.geometry
    ctypes.memset(g.base + block * g.block_stride + g.segment_offsets[0], 0x77, 64)


class Served:
    """One source and the requests it holds."""

    def __init__(self, spec: dict[str, Any]):
        from kvshare_connector.backends.options import ConnectorOptions
        from kvshare_connector.demo import kvcheck
        from kvshare_connector.demo.parts import build, cpu_digester, cpu_packer
        from kvshare_connector.layout.matching import EngineIdentity
        from kvshare_connector.transfer.device.nixl import NixlTransport
        from kvshare_connector.transfer.prefill.source import KVSource
        from kvshare_connector.transfer.wire.kv_params import kv_transfer_params
        from kvshare_connector.transfer.wire.settings import EngineSettings

        self.name = spec["name"]
        kv_mib = spec.get("kv_mib", 64)
        tokens = spec.get("tokens", 300)
        count = spec.get("requests", 1)
        seed = spec.get("seed", 100)
        lease_s = spec.get("lease_s", 300.0)
        self.stack, topology = build(
            spec["model"], spec["layout"], kv_mib, spec.get("max_model_len", 2048)
        )
        requests = disjoint_requests(topology, tokens, count, seed)
        if spec.get("fill", "pattern") == "pattern":
            for index, ids in enumerate(requests):
                kvcheck.fill(self.stack.kv_caches, topology, ids, seed=seed + index)
        else:
            for region in topology.regions:
                ctypes.memset(region.addr, 0x5A, region.nbytes)
        engine_id = f"{self.name}-{uuid.uuid4().hex[:8]}"
        identity = EngineIdentity(**spec["identity"]) if spec.get("identity") else None
        # Packed transfer: a host staging area over the KV (0: block by block).
        packer = cpu_packer(self.stack, spec.get("packed_mib", 0))
        probe = None
        if spec.get("probe_mib"):
            from kvshare_connector.transfer.device.probe import ProbeBuffer

            probe = ProbeBuffer(spec["probe_mib"] << 20, "cpu", seed=seed)
            if spec.get("probe_lie"):
                probe.seed = seed + 1  # the handshake names a pattern the buffer does not hold
        settings = EngineSettings(
            engine_id,
            port=spec.get("port", 0),
            lease_s=lease_s,
            identity=identity,
            secret=spec["secret"].encode() if spec.get("secret") else None,
        )
        self.source = KVSource(
            topology,
            NixlTransport(engine_id, **ConnectorOptions.parse(None).nixl_progress),
            settings,
            packer=packer,
            digester=cpu_digester(self.stack) if spec.get("verify") else None,
            probe=probe,
        )
        self.started = time.monotonic()
        described = []
        for index, ids in enumerate(requests):
            request_id = f"{self.name}-req-{index}"
            self.source.hold(request_id, block_ids=ids)  # claims may name only these
            if index in spec.get("corrupt", []):
                packed = self.source.packed_slot(request_id)
                if packed is None:
                    overwrite_first_block(topology, ids)
                else:  # what decode reads is the packed copy: change that
                    packed.copy.wait()
                    ctypes.memset(self.source.packer.staging.addr + packed.slot, 0x77, 64)
            params = kv_transfer_params(
                remote_block_ids=ids,
                remote_engine_id=engine_id,
                remote_request_id=request_id,
                remote_host=self.source.host,
                remote_port=self.source.port,
                remote_num_tokens=tokens,
            )
            described.append(
                {"request_id": request_id, "seed": seed + index, "kv_transfer_params": params}
            )
        emit(
            PREFIX_READY,
            {
                "name": self.name,
                "engine_id": engine_id,
                "host": self.source.host,
                "port": self.source.port,
                "model": spec["model"],
                "layout": topology.layout,
                "owners": len(topology.owners),
                "sharers": len(topology.sharers),
                "num_blocks": topology.num_blocks,
                "registered_bytes": self.source.transport.registered_bytes,
                "lease_s": lease_s,
                "requests": described,
            },
        )

    def poll(self) -> None:
        read, expired = self.source.poll()
        if read or expired:
            emit(
                PREFIX_RELEASED,
                {
                    "name": self.name,
                    "read": sorted(read),
                    "expired": sorted(expired),
                    "held": sorted(self.source.held),
                    "after_s": time.monotonic() - self.started,
                },
            )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sources", required=True, help="JSON list of source specs")
    args = parser.parse_args()
    # SIGUSR1 dumps every thread's stack to stderr: a test whose wait for this peer times
    # out sends it, so the failure says where the peer was stuck.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    served = [Served(spec) for spec in json.loads(args.sources)]
    emit(PREFIX_ALL_READY, {})

    stdin_closed = threading.Event()

    def watch_stdin() -> None:
        for _ in sys.stdin:
            pass
        stdin_closed.set()

    threading.Thread(target=watch_stdin, daemon=True).start()
    while not stdin_closed.is_set():  # NIXL calls stay on this thread
        for s in served:
            s.poll()
        time.sleep(0.005)
    emit(PREFIX_BYE, {s.name: {"held": sorted(s.source.held)} for s in served})
    for s in served:
        s.source.close()
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # skip seconds of vLLM/torch interpreter teardown


# ---- the test side ------------------------------------------------------------------------


def peer_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """A test peer's environment: its NIXL agents run without NIXL's progress thread unless
    the caller says otherwise. (When that thread spun, before ``nixl_progress_poll_ms``, a
    peer's seven agents and the test process's dozen kept every core of a 2-core CI box
    busy and peers took over 300 s to start; the threads now sleep, tests/
    test_nixl_progress.py, but the peers keep the setting they were written for.) A peer
    polls its sources all the time, which progresses them (the connector's engines keep
    the thread on by default: tests/test_kv_probe.py, test_connector.py)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.setdefault("KVSHARE_NIXL_PROGRESS_THREAD", "0")  # read by ConnectorOptions.parse
    return {**env, **(extra or {})}


class PeerProcess:
    """A running ``transfer_peer.py``: its lines are read by a thread, so waits are bounded
    and a chatty peer never blocks on a full pipe."""

    def __init__(self, sources: list[dict[str, Any]], env: dict[str, str] | None = None):
        import subprocess
        from collections import deque

        self.sources = {s["name"]: s for s in sources}
        self.process = subprocess.Popen(
            [sys.executable, __file__, "--sources", json.dumps(sources)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=peer_env(env),
        )
        self.ready: dict[str, dict[str, Any]] = {}
        self.released: list[dict[str, Any]] = []
        self.bye: dict[str, Any] | None = None
        self.all_ready = threading.Event()
        self.stderr_tail: deque[str] = deque(maxlen=120)
        self._changed = threading.Condition()
        threading.Thread(target=self._read_stdout, daemon=True).start()
        threading.Thread(target=self._read_stderr, daemon=True).start()

    def _read_stdout(self) -> None:
        from kvshare_connector.common.child_process import report_of

        assert self.process.stdout is not None
        for line in self.process.stdout:
            try:
                found = report_of(
                    line, (PREFIX_READY, PREFIX_ALL_READY, PREFIX_RELEASED, PREFIX_BYE)
                )
            except ValueError as exc:  # named in the next failure; later lines still count
                self.stderr_tail.append(str(exc))
                continue
            if found is None:
                continue
            prefix, body = found
            with self._changed:
                if prefix == PREFIX_READY:
                    self.ready[body["name"]] = body
                elif prefix == PREFIX_ALL_READY:
                    self.all_ready.set()
                elif prefix == PREFIX_RELEASED:
                    self.released.append(body)
                elif prefix == PREFIX_BYE:
                    self.bye = body
                self._changed.notify_all()
        with self._changed:
            self._changed.notify_all()

    def _read_stderr(self) -> None:
        assert self.process.stderr is not None
        for line in self.process.stderr:
            self.stderr_tail.append(line.rstrip())

    def _wait(self, predicate: Any, timeout_s: float, what: str) -> Any:
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while True:
                value = predicate()
                if value:
                    return value
                left = deadline - time.monotonic()
                if left <= 0 or (self.process.poll() is not None and not value):
                    if self.process.poll() is None:  # alive: ask for its stacks (main())
                        self.process.send_signal(signal.SIGUSR1)
                        self._changed.wait(2.0)
                    tail = "\n".join(list(self.stderr_tail)[-80:])
                    raise TimeoutError(
                        f"peer: {what} not seen in {timeout_s:g} s "
                        f"(exit code {self.process.poll()}); stderr tail:\n{tail}"
                    )
                self._changed.wait(min(left, 0.1))

    def source(self, name: str, timeout_s: float = 300.0) -> dict[str, Any]:
        """The READY description of source ``name``, once the peer polls all its sources
        (waits for that: a peer building many vLLM stacks on a loaded 2-core box can take
        minutes, and UCX wires a first READ up only while the peer progresses)."""
        info = self._wait(lambda: self.ready.get(name), timeout_s, f"source {name} ready")
        self._wait(self.all_ready.is_set, timeout_s, "all sources ready")
        return info

    def request(self, name: str, index: int) -> dict[str, Any]:
        return self.source(name)["requests"][index]

    def released_event(self, name: str, request_id: str, timeout_s: float = 10.0) -> dict:
        """The RELEASED line of source ``name`` that freed ``request_id``."""

        def find() -> dict | None:
            for event in self.released:
                if event["name"] == name and request_id in event["read"] + event["expired"]:
                    return event
            return None

        return self._wait(find, timeout_s, f"release of {request_id}")

    def events(self, name: str) -> list[dict[str, Any]]:
        with self._changed:
            return [e for e in self.released if e["name"] == name]

    def kill(self) -> None:
        """SIGKILL, no goodbye."""
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(timeout=10)

    def __enter__(self) -> PeerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Close stdin (the peer says BYE and exits); kill it if it does not."""
        import subprocess

        if self.process.poll() is None:
            try:
                assert self.process.stdin is not None
                self.process.stdin.close()
                self.process.wait(timeout=timeout_s)
            except (subprocess.TimeoutExpired, OSError, BrokenPipeError):
                pass
        self.kill()
