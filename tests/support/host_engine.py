"""An engine on one of two hosts (``two_hosts``): vLLM's scheduler with KVShareConnector
over vLLM-made CPU KV (``lab/tools/engine_sim.Engine``), driven by JSON lines on stdin.

It steps all the time (prefill frees what decode read or what outlived its lease; decode
moves its reads), except while a decode batch is paused. Commands::

    {"op": "prefill", "ids": [1, 2]}   compute requests p1, p2; PREFILLED {"p1": params, ...}
    {"op": "decode", "ids": [1, 2], "params": {...}, "pause": true}
        load d1, d2 from those params; with pause, the engine thread stops right after NIXL
        posted the first READ (POSTED), until {"op": "resume"};
        DECODED {"d1": {"error", "loaded", "computed", "mismatches", "seconds"}}
    {"op": "state"}                    STATE {"held", "free_blocks", "total_blocks"}

With NIXL's progress thread off (decode's option here), a paused decode moves no byte of
its READ: it is in flight, its bytes held in the sockets, until the engine goes on.

    python tests/support/host_engine.py prefill|decode --port P --extra JSON
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

POSTED, DECODED, PREFILLED, STATE, READY = "POSTED ", "DECODED ", "PREFILLED ", "STATE ", "READY "
PREFIXES = (POSTED, DECODED, PREFILLED, STATE, READY)


class PauseAfterPost:
    """Wraps decode's NIXL ``transfer``: once armed, the READ it posts next is reported
    (POSTED) and the engine thread waits there until ``resume`` is set."""

    def __init__(self, engine: Any):
        self.agent = engine.worker.worker.backend.sink.sink.transport.agent
        self.original = self.agent.transfer
        self.armed = False
        self.resume = threading.Event()
        self.agent.transfer = self._transfer

    def _transfer(self, handle: Any) -> Any:
        from kvshare_connector.common.child_process import report

        state = self.original(handle)
        if self.armed:
            self.armed = False
            report(POSTED, {"state": str(state)})
            self.resume.wait()
            self.resume.clear()
        return state


def _decoded(engine: Any, ids: Sequence[str], started: float) -> dict[str, Any]:
    """Per request: its load's error (None: loaded through PD), whether decode computed the
    prompt itself, and a loaded request's KV that differs from prefill's pattern."""
    out = {}
    for rid in ids:
        error = (engine.outputs[rid].kv_transfer_params or {}).get("kv_load_error")
        out[rid] = {
            "error": error,
            "loaded": error is None and rid in engine.loaded,
            "computed": rid in engine.written,
            "mismatches": engine.loaded.get(rid, []) if error is None else [],
            "seconds": time.monotonic() - started,
        }
    return out


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("role", choices=["prefill", "decode"])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--model", default="gemma4_e2b_shape")
    parser.add_argument("--tokens", type=int, default=1000)
    parser.add_argument("--kv-mib", type=int, default=192)
    parser.add_argument("--extra", type=json.loads, default={})
    args = parser.parse_args()

    from kvshare_connector.common.child_process import report
    from lab.tools.engine_sim import Engine

    role = "kv_producer" if args.role == "prefill" else "kv_consumer"
    engine = Engine(args.model, "per_layer", role, args.port, args.extra,
                    failure_policy="recompute", kv_bytes=args.kv_mib << 20)  # fmt: skip
    commands: queue.Queue[dict | None] = queue.Queue()

    pause = PauseAfterPost(engine) if args.role == "decode" else None

    def read_stdin() -> None:
        for line in sys.stdin:
            command = json.loads(line)
            if command.get("op") == "resume":  # the engine thread waits inside a step
                assert pause is not None
                pause.resume.set()
            else:
                commands.put(command)
        commands.put(None)
        if pause is not None:
            pause.resume.set()

    threading.Thread(target=read_stdin, daemon=True).start()
    report(READY, {"pid": os.getpid()})
    batch: dict[str, Any] | None = None  # decode: the requests of the last decode command
    while True:
        try:
            command = commands.get_nowait()
        except queue.Empty:
            command = {}
        if command is None:
            break
        op = command.get("op")
        if op == "prefill":
            ids = [f"p{i}" for i in command["ids"]]
            for i, rid in zip(command["ids"], ids, strict=True):
                engine.add(rid, args.tokens, 1, {"do_remote_decode": True}, i)
            engine.run_until(lambda ids=ids: all(r in engine.outputs for r in ids))
            report(PREFILLED, {r: engine.outputs[r].kv_transfer_params for r in ids})
        elif op == "decode":
            ids = [f"d{i}" for i in command["ids"]]
            for i, rid in zip(command["ids"], ids, strict=True):
                engine.add(rid, args.tokens, 2, command["params"][f"p{i}"], i)
            batch = {"ids": ids, "started": time.monotonic()}
            if command.get("pause"):
                assert pause is not None
                pause.armed = True
        elif op == "state":
            pool = engine.scheduler.kv_cache_manager.block_pool
            source = engine.worker.worker.backend.source
            report(STATE, {"held": sorted(source.held), "free_blocks": pool.get_num_free_blocks(),
                           "total_blocks": pool.num_gpu_blocks - 1})  # fmt: skip
        engine.step()
        if batch is not None and all(rid in engine.outputs for rid in batch["ids"]):
            report(DECODED, _decoded(engine, batch["ids"], batch["started"]))
            batch = None
        time.sleep(0.002)
    engine.close()
    return 0


# ---- the test side ------------------------------------------------------------------------


class HostEngine:
    """A running ``host_engine.py`` on a host of ``pair``: commands in, reports out."""

    def __init__(self, pair: Any, role: str, port: int, extra: dict, env: dict[str, str]):
        argv = [sys.executable, __file__, role, "--port", str(port), "--extra", json.dumps(extra)]
        self.process = subprocess.Popen(
            pair.command(role, argv), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True, env={**pair.env, **env, "PYTHONUNBUFFERED": "1"},
        )  # fmt: skip
        self.reports: queue.Queue[tuple[str, Any]] = queue.Queue()
        self.log: list[str] = []
        threading.Thread(target=self._read_reports, daemon=True).start()
        threading.Thread(target=self._read_log, daemon=True).start()

    def _read_reports(self) -> None:
        from kvshare_connector.common.child_process import report_of

        assert self.process.stdout is not None
        for line in self.process.stdout:
            found = report_of(line, PREFIXES)
            if found is not None:
                self.reports.put(found)

    def _read_log(self) -> None:
        assert self.process.stderr is not None
        for line in self.process.stderr:
            self.log.append(line)

    def send(self, **command: Any) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps(command) + "\n")
        self.process.stdin.flush()

    def wait(self, prefix: str, timeout_s: float) -> Any:
        """The payload of the next report with ``prefix`` (others before it are dropped)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                got, payload = self.reports.get(timeout=0.2)
            except queue.Empty:
                if self.process.poll() is not None:
                    break
                continue
            if got == prefix:
                return payload
        tail = "".join(self.log[-40:])
        raise TimeoutError(f"no {prefix.strip()} in {timeout_s:g} s "
                           f"(exit {self.process.poll()}); log tail:\n{tail}")  # fmt: skip

    def ask(self, prefix: str, timeout_s: float = 60.0, **command: Any) -> Any:
        self.send(**command)
        return self.wait(prefix, timeout_s)

    def kill(self) -> None:
        """SIGKILL to the host's init: every process on it dies (``--kill-child``)."""
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(timeout=10)

    def stop(self) -> None:
        """Close stdin (the engine shuts down); kill it if it does not exit."""
        if self.process.poll() is None:
            try:
                assert self.process.stdin is not None
                self.process.stdin.close()
                self.process.wait(timeout=20)
            except (subprocess.TimeoutExpired, OSError):
                pass
        self.kill()


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # skip seconds of vLLM/torch interpreter teardown
