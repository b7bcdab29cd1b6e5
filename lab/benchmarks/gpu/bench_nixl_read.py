"""NIXL READ bandwidth between two processes: a "prefill" target and a "decode" initiator.

Why: on one host decode's READ of prefill's KV should ride UCX's cuda_ipc over NVLink, but
whether UCX can use cuda_ipc depends on what lies outside the connector: which GPUs each process
sees (CUDA_VISIBLE_DEVICES), how the target memory was allocated (cudaMalloc is legacy-IPC
capable; cuMemCreate memory only with a shareable handle type UCX can export) and UCX_* env.
Each variant runs in two fresh child processes with their own environment, and each descriptor
size is verified after its first READ, so a fast but wrong path cannot pass.

  python -m lab.benchmarks.gpu.bench_nixl_read --mode cpu --total-mib 64 --desc-kib 64 1024
  python -m lab.benchmarks.gpu.bench_nixl_read --mode gpu --ucx-info \\
      --sweep-env default vis=0,1/1,0 vis=0,1/1,0+alloc=vmm vis=0,1/1,0+alloc=cumem

Variant items, joined by '+': default | tls=V (UCX_TLS) | vis=T/I (CUDA_VISIBLE_DEVICES of
target/initiator) | alloc=cudamalloc|vmm|cumem | mib=N | KEY=V (any upper-case env var).
GB/s is 1e9 bytes/s from post to DONE; "prep ms" is initialize_xfer.
"""

import argparse
import base64
import contextlib
import ctypes
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

ALLOCS = ("cudamalloc", "vmm", "cumem")
HANDLE_TYPES = {"none": 0, "posix_fd": 1, "fabric": 8}  # CUmemAllocationHandleType bits
SHOWN_ENV = re.compile(r"^(UCX_|NIXL_|CUDA_VISIBLE_DEVICES$|PYTORCH_CUDA_ALLOC_CONF$)")
LOG_LINE = re.compile(r"ucp_worker.*cfg#|UCX_\* env|cuIpc|cuda.ipc|cuMem|UCX +(WARN|ERROR)")
LOG_PREFIX = re.compile(r"^\[[\d.]+\] \[[^]]*\] +")  # UCX timestamp and host:pid
CONFIG_LINE = re.compile(
    r"^UCX_(TLS|NET_DEVICES|CUDA_IPC_|CUDA_COPY_|RNDV_THRESH|RNDV_SCHEME|PROTO_EN)"
)
CHUNK = 1 << 24  # int32 words compared at a time: bounds the extra memory to 64 MiB
UCX_IPC_PATH = {  # what UCX 1.23's cuda_ipc does with memory of each kind (cuda_ipc_md.c)
    "legacy": "legacy cuIpcGetMemHandle",
    "fabric": "fabric handle (needs IMEX / fabric manager)",
    "posix_fd": "posix fd: only if UCX was built with pidfd_getfd, else NO_IPC",
    "none": "NO_IPC: cuda_ipc cannot export this memory",
}


# ---------------------------------------------------------------------------- child side
def _send(conn: Connection, **msg: Any) -> None:
    conn.send_bytes(json.dumps(msg).encode())


def _recv(conn: Connection, timeout: float) -> dict[str, Any]:
    if not conn.poll(timeout):
        raise TimeoutError("no message from the parent")
    return json.loads(conn.recv_bytes())


def _cu(fn: str, *args: Any, check: bool = True) -> int:
    if (rc := getattr(ctypes.CDLL("libcuda.so.1"), fn)(*args)) and check:
        raise RuntimeError(f"{fn} failed: CUresult {rc}")
    return rc


def _cumem_tensor(torch: Any, nbytes: int, handle_type: int) -> Any:
    """cuMemCreate + cuMemMap as kvcached 0.1.x does it (it leaves the handle type at 0)."""
    u64, size_t, ref = ctypes.c_uint64, ctypes.c_size_t, ctypes.byref
    # CUmemAllocationProp as 8 ints: PINNED, handle types, location DEVICE 0, zero padding
    prop, gran, handle, ptr = (ctypes.c_int * 8)(1, handle_type, 1, 0), size_t(), u64(), u64()
    _cu("cuMemGetAllocationGranularity", ref(gran), ref(prop), 0)
    size = size_t(-(-nbytes // gran.value) * gran.value)
    _cu("cuMemCreate", ref(handle), size, ref(prop), u64(0))
    _cu("cuMemAddressReserve", ref(ptr), size, size_t(0), u64(0), u64(0))
    _cu("cuMemMap", ptr, size, size_t(0), handle, u64(0))
    access = (ctypes.c_int * 3)(1, 0, 3)  # CUmemAccessDesc: DEVICE 0, PROT_READWRITE
    _cu("cuMemSetAccess", ptr, size, ref(access), size_t(1))
    iface = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr.value, False), "version": 3}
    holder = type("CuMem", (), {"__cuda_array_interface__": iface})()
    return torch.as_tensor(holder, device="cuda:0")


def _ipc_info(ptr: int) -> dict[str, Any]:
    """The two pointer attributes UCX's cuda_ipc decides on when it registers ``ptr``."""
    legacy, types = ctypes.c_int(0), ctypes.c_uint64(0)
    rc = _cu("cuPointerGetAttribute", ctypes.byref(legacy), 10, ctypes.c_uint64(ptr), check=False)
    rc |= _cu("cuPointerGetAttribute", ctypes.byref(types), 14, ctypes.c_uint64(ptr), check=False)
    kinds = [k for k, bit in HANDLE_TYPES.items() if types.value & bit] or ["none"]
    path = "legacy" if legacy.value else kinds[-1]  # fabric wins over posix_fd in UCX
    return {"legacy_ipc": legacy.value, "handle_types": "|".join(kinds), "query_rc": rc,
            "ucx_cuda_ipc": UCX_IPC_PATH[path]}  # fmt: skip


def _allocate(torch: Any, cfg: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    nbytes = cfg["mib"] << 20
    if cfg["mode"] == "cpu":
        return torch.empty(nbytes, dtype=torch.uint8), {"mem": "DRAM", "dev": 0}
    torch.cuda.set_device(0)
    torch.zeros(1, device="cuda:0")  # makes the primary context current for driver calls
    if cfg["role"] == "target" and cfg["alloc"] == "cumem":
        buf = _cumem_tensor(torch, nbytes, HANDLE_TYPES[cfg["cumem_handle"]])
    else:
        buf = torch.empty(nbytes, dtype=torch.uint8, device="cuda:0")
    props = torch.cuda.get_device_properties(0)
    info = {"mem": "VRAM", "dev": 0, "gpu": props.name, "visible": torch.cuda.device_count(),
            "pci_bus": getattr(props, "pci_bus_id", "?")}  # fmt: skip
    return buf, {**info, **_ipc_info(buf.data_ptr())}


def _pattern(torch: Any, buf: Any, nbytes: int, check: bool) -> int | None:
    """Fill (target) or check (initiator) int32 words i+1; return the first bad byte offset."""
    words = buf.view(torch.int32)[: nbytes // 4]
    for s in range(0, words.numel(), CHUNK):
        n = min(CHUNK, words.numel() - s)
        want = torch.arange(s + 1, s + 1 + n, dtype=torch.int32, device=buf.device)
        if not check:
            words[s : s + n].copy_(want)
        elif (bad := (words[s : s + n] != want).nonzero()).numel():
            return (s + int(bad[0])) * 4
    return None


def _agent(name: str, params: dict[str, str]) -> Any:
    try:
        from nixl._api import nixl_agent, nixl_agent_config
    except ImportError:  # the nixl-cu13 wheel alone installs only the nixl_cu13 package
        from nixl_cu13._api import nixl_agent, nixl_agent_config
    agent = nixl_agent(name, nixl_agent_config(backends=[] if params else ["UCX"]))
    if params:
        agent.create_backend("UCX", params)
    return agent


def _loaded_lib(stem: str) -> str | None:
    with open("/proc/self/maps") as maps:
        paths = (line.split()[-1] for line in maps)
        return next((p for p in paths if f"/{stem}" in p and ".so" in p), None)


def _ucx_version() -> str:
    if (path := _loaded_lib("libucp")) is None:
        return "libucp not loaded"
    lib = ctypes.CDLL(path)
    lib.ucp_get_version_string.restype = ctypes.c_char_p
    return f"{lib.ucp_get_version_string().decode()} ({path})"


def _print_ucx_config() -> None:
    """``ucx_info -c`` of the UCX that NIXL loaded: the nixl wheel ships no ucx_info."""
    if (path := _loaded_lib("libucs")) is None:
        return
    ucs, libc = ctypes.CDLL(path), ctypes.CDLL(None)
    fn = ucs.ucs_config_parser_print_all_opts
    fn.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_char_p]
    head = ctypes.addressof(ctypes.c_char.in_dll(ucs, "ucs_config_global_list"))
    libc.fflush(None)
    fn(ctypes.c_void_p.in_dll(libc, "stdout"), b"UCX_", 1, head, None)  # 1: PRINT_CONFIG


def _env_view() -> dict[str, str]:
    return {k: v for k, v in sorted(os.environ.items()) if SHOWN_ENV.match(k)}


def _bench_size(torch: Any, agent: Any, buf: Any, peer: dict, kib: int, cfg: dict) -> dict:
    desc = kib << 10
    n = (cfg["mib"] << 20) // desc
    row: dict[str, Any] = {"desc_kib": kib, "descriptors": n, "mib": n * desc / 2**20}
    if n < (2 if cfg["negative_control"] else 1):
        return {**row, "verified": False, "error": f"too few {kib} KiB descriptors"}
    offs = np.arange(n, dtype=np.uint64) * np.uint64(desc)
    roffs = np.roll(offs, -1) if cfg["negative_control"] else offs  # shift by one descriptor

    def descs(base: int, o: np.ndarray, dev: int, mem: str) -> Any:
        cols = [np.uint64(base) + o, np.full(n, desc, np.uint64), np.full(n, dev, np.uint64)]
        return agent.get_xfer_descs(np.stack(cols, axis=1), mem)

    local = descs(buf.data_ptr(), offs, 0, cfg["mem"])
    remote = descs(peer["addr"], roffs, peer["dev"], peer["mem"])
    buf.zero_()
    if cfg["mode"] == "gpu":
        torch.cuda.synchronize()
    iter_s, prep_s = [], []
    for it in range(cfg["iters"] + 1):
        t0 = time.perf_counter()
        handle = agent.initialize_xfer("READ", local, remote, peer["name"], b"bench")
        t1 = time.perf_counter()
        state = agent.transfer(handle)
        while state == "PROC":
            state = agent.check_xfer_state(handle)
        t2 = time.perf_counter()
        agent.release_xfer_handle(handle)
        if state != "DONE":
            raise RuntimeError(f"READ of {kib} KiB descriptors ended in state {state}")
        if it == 0:  # the warm-up READ is the verified one
            if (bad := _pattern(torch, buf, n * desc, check=True)) is not None:
                return {**row, "verified": False, "error": f"{kib} KiB: bad data at byte {bad}"}
            continue
        iter_s.append(t2 - t1)
        prep_s.append(t1 - t0)
    return {**row, "verified": True, "iter_s": iter_s, "prep_s": prep_s}


def child_main(cfg: dict[str, Any]) -> int:
    """One side of a variant; talks JSON to the parent over a localhost socket."""
    conn = Connection(socket.create_connection(("127.0.0.1", cfg["port"])).detach())
    rc = 1
    try:
        import torch

        _send(conn, kind="hello", role=cfg["role"])
        buf, info = _allocate(torch, cfg)
        cfg["mem"] = info["mem"]
        agent = _agent(cfg["role"], dict(kv.split("=", 1) for kv in cfg["backend_params"]))
        agent.register_memory([(buf.data_ptr(), buf.numel(), 0, "")], mem_type=info["mem"])
        side = {"info": info, "env": _env_view(), "ucx": _ucx_version()}
        if cfg["role"] == "target":
            _pattern(torch, buf, buf.numel(), check=False)
            if cfg["mode"] == "gpu":
                torch.cuda.synchronize()
            meta = base64.b64encode(agent.get_agent_metadata()).decode()
            where = {"addr": buf.data_ptr(), "dev": 0, "mem": info["mem"]}
            _send(conn, kind="ready", meta=meta, **where, **side)
            _recv(conn, cfg["timeout"] + 60)  # serve READs until the parent says exit
        else:
            peer = _recv(conn, cfg["timeout"])
            peer["name"] = agent.add_remote_agent(base64.b64decode(peer["meta"]))
            sizes = [_bench_size(torch, agent, buf, peer, kib, cfg) for kib in cfg["desc_kib"]]
            _send(conn, kind="result", sizes=sizes, **side)
        if cfg["ucx_info"] and cfg["role"] == "initiator":
            _print_ucx_config()  # env and defaults; NIXL overrides a few per context
        rc = 0
    except Exception as exc:
        with contextlib.suppress(OSError):
            _send(conn, kind="error", error=f"{cfg['role']}: {type(exc).__name__}: {exc}")
    sys.stdout.flush()
    ctypes.CDLL(None).fflush(None)  # UCX's protocol tables sit in C stdio buffers
    os._exit(rc)  # skip agent teardown: a hung UCX shutdown must not turn into a TIMEOUT


# --------------------------------------------------------------------------- parent side
class ChildFailed(RuntimeError):
    """A child exited, reported an error or closed its socket."""


def parse_variant(spec: str, args: argparse.Namespace) -> dict[str, Any]:
    both = dict(kv.split("=", 1) for kv in args.env)
    vis = {"target": args.target_visible, "initiator": args.initiator_visible}
    var = {"name": spec, "alloc": args.alloc, "mib": args.total_mib, "both": both, "vis": vis}
    for item in spec.split("+"):
        key, sep, val = item.partition("=")
        if item == "default":
            continue
        if not sep:
            raise SystemExit(f"variant item {item!r} is not KEY=VALUE")
        if key == "tls":
            both["UCX_TLS"] = val
        elif key == "vis":
            tvis, _, ivis = val.partition("/")
            var["vis"] = {"target": tvis, "initiator": ivis or tvis}
        elif key == "alloc" and val in ALLOCS:
            var["alloc"] = val
        elif key == "mib":
            var["mib"] = int(val)
        elif key.isupper():
            both[key] = val
        else:
            raise SystemExit(f"unknown variant item {item!r}")
    return var


def child_env(var: dict[str, Any], role: str, args: argparse.Namespace) -> dict[str, str]:
    env = {**os.environ, **var["both"], "PYTHONUNBUFFERED": "1"}
    if args.mode == "gpu":
        env["CUDA_VISIBLE_DEVICES"] = var["vis"][role]
    if args.ucx_info:  # an explicit UCX_LOG_LEVEL (e.g. debug) wins
        env = {"UCX_PROTO_INFO": "y", "UCX_LOG_LEVEL": "info", **env}
    if role == "target" and var["alloc"] == "vmm":  # torch reads it at import in the child
        conf = env.get("PYTORCH_CUDA_ALLOC_CONF")
        env["PYTORCH_CUDA_ALLOC_CONF"] = ",".join(filter(None, [conf, "expandable_segments:True"]))
    return env


def _wait(conn: Connection, procs: dict, deadline: float, kind: str) -> dict[str, Any]:
    while time.monotonic() < deadline:
        for role, proc in procs.items():
            if proc.poll() is not None and not conn.poll(0):
                raise ChildFailed(f"{role} exited with rc={proc.returncode}")
        if conn.poll(0.2):
            try:
                msg = json.loads(conn.recv_bytes())
            except EOFError as exc:
                raise ChildFailed("a child closed its socket") from exc
            if msg["kind"] == "error":
                raise ChildFailed(msg["error"])
            if msg["kind"] == kind:
                return msg
    raise TimeoutError(kind)


def run_variant(var: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """Start target and initiator afresh, relay the target's metadata, collect the result."""
    srv = socket.create_server(("127.0.0.1", 0))
    srv.settimeout(0.5)
    cfg = {**vars(args), "mib": var["mib"], "alloc": var["alloc"], "port": srv.getsockname()[1]}
    alloc = var["alloc"] if args.mode == "gpu" else "dram"
    alloc += f":{args.cumem_handle}" if alloc == "cumem" else ""
    out: dict[str, Any] = {"name": var["name"], "alloc": alloc, "status": "ok"}
    out.update(sides={}, sizes=[], logs={})
    conns: dict[str, Connection] = {}
    deadline = time.monotonic() + args.timeout
    with tempfile.TemporaryFile("w+") as tlog, tempfile.TemporaryFile("w+") as ilog:
        logs, procs = {"target": tlog, "initiator": ilog}, {}
        me = os.path.abspath(__file__)
        for role, log in logs.items():
            cmd = [sys.executable, me, "--child", json.dumps({**cfg, "role": role})]
            env = child_env(var, role, args)
            procs[role] = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            while len(conns) < 2:
                if time.monotonic() > deadline:
                    raise TimeoutError("children did not connect")
                with contextlib.suppress(TimeoutError):
                    conn = Connection(srv.accept()[0].detach())
                    conns[_wait(conn, procs, deadline, "hello")["role"]] = conn
                for role, proc in procs.items():
                    if proc.poll() is not None:
                        raise ChildFailed(f"{role} exited with rc={proc.returncode}")
            ready = _wait(conns["target"], procs, deadline, "ready")
            out["sides"]["target"] = {k: ready[k] for k in ("info", "env", "ucx")}
            _send(conns["initiator"], **ready)
            result = _wait(conns["initiator"], procs, deadline, "result")
            out["sides"]["initiator"] = {k: result[k] for k in ("info", "env", "ucx")}
            out["sizes"] = result["sizes"]
        except TimeoutError:
            out["status"] = f"TIMEOUT after {args.timeout:.0f} s"
        except ChildFailed as exc:
            out["status"] = f"ERROR: {exc}"
        finally:
            for conn in conns.values():
                with contextlib.suppress(OSError):
                    _send(conn, kind="exit")
            for proc in procs.values():
                try:
                    proc.wait(15)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
            srv.close()
        for role, log in logs.items():
            log.seek(0)
            out["logs"][role] = log.read()[-400_000:]
    return out


def _log_lines(res: dict[str, Any], role: str, ucx_info: bool) -> list[str]:
    """UCX lane choices, warnings, config and only the READ (ucp_get) protocol tables."""
    lines, picked, in_read = res["logs"][role].splitlines(), [], False
    if res["status"] != "ok":
        return lines[-25:]
    for line in lines:
        in_read = "memory read" in line if "by ucp_" in line else in_read
        keep = in_read and "cfg#" not in line if "|" in line else LOG_LINE.search(line)
        if CONFIG_LINE.match(line) or (ucx_info and keep):
            picked.append(LOG_PREFIX.sub("", line))
    return list(dict.fromkeys(picked))[:150]


def report(results: list[dict[str, Any]], args: argparse.Namespace) -> list[str]:
    """Print each variant's context and one combined table; return the failures."""
    failures, table = [], []
    for res in results:
        print(f"\n## variant {res['name']}: {res['status']}")
        for role in ("target", "initiator"):
            if side := res["sides"].get(role):
                print(f"- {role}: {json.dumps(side['info'])}\n  env: {side['env']}")
                print(f"  ucx: {side['ucx']}")
            for line in _log_lines(res, role, args.ucx_info):
                print(f"  {role}> {line}")
        head = f"| {res['name']} | {res['alloc']} |"
        if res["status"] != "ok":
            failures.append(f"{res['name']}: {res['status']}")
            table.append(f"{head} - | - | - | {res['status']} | - | - | - | no |")
        for row in res["sizes"]:
            cells = f"{head} {row['desc_kib']} | {row['descriptors']} | {row['mib']:.0f} |"
            if not row["verified"]:
                failures.append(f"{res['name']}: VERIFICATION FAILED: {row['error']}")
                table.append(f"{cells} - | - | - | - | NO |")
                continue
            gbps = [row["mib"] * 2**20 / t / 1e9 for t in row["iter_s"]]
            prep = statistics.median(row["prep_s"]) * 1e3
            stats = f"{statistics.median(gbps):.2f} | {min(gbps):.2f} | {max(gbps):.2f}"
            table.append(f"{cells} {stats} | {prep:.2f} | yes |")
    print("\n| variant | alloc | desc KiB | descs | MiB | median GB/s | min | max | prep ms | ok |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---|")
    print("\n".join(table))
    return failures


def main() -> int:
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        return child_main(json.loads(sys.argv[2]))
    raw = argparse.RawDescriptionHelpFormatter
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=raw)
    add = ap.add_argument
    add("--mode", choices=("cpu", "gpu"), default="gpu")
    add("--total-mib", type=int, default=1024, help="bytes per READ (MiB)")
    add("--desc-kib", type=int, nargs="+", default=[16, 64, 256, 1024, 16384])
    add("--iters", type=int, default=5, help="timed READs per size, after 1 verified warm-up")
    add("--alloc", choices=ALLOCS, default="cudamalloc", help="target memory, see above")
    add("--cumem-handle", choices=tuple(HANDLE_TYPES), default="none", help="for --alloc cumem")
    add("--target-visible", default="0", help="CUDA_VISIBLE_DEVICES of the target (gpu mode)")
    add("--initiator-visible", default="1", help="CUDA_VISIBLE_DEVICES of the initiator")
    add("--backend-params", nargs="*", default=[], metavar="K=V", help="UCX backend init params")
    add("--env", nargs="*", default=[], metavar="K=V", help="extra env for both children")
    add("--sweep-env", nargs="+", default=["default"], metavar="VARIANT")
    add("--ucx-info", action="store_true", help="UCX_PROTO_INFO=y UCX_LOG_LEVEL=info + config")
    add("--negative-control", action="store_true", help="read remote desc i+1 into local i")
    add("--timeout", type=float, default=120.0, help="seconds per variant (both children)")
    add("--json", metavar="PATH", help="raw per-iteration times and child logs")
    args = ap.parse_args()
    if args.total_mib >= 8192:
        raise SystemExit("--total-mib must stay below 8192 (int32 pattern)")
    variants = [parse_variant(spec, args) for spec in args.sweep_env]
    print(f"# NIXL READ bench, mode={args.mode}; parent env: {_env_view()}")
    results = [run_variant(var, args) for var in variants]
    failures = report(results, args)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"args": vars(args), "variants": results}, fh, indent=1)
    for failure in failures:
        print(f"FAILED: {failure}", file=sys.stderr)
    if failures and args.negative_control:
        print("(expected: --negative-control reads shifted offsets)", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
