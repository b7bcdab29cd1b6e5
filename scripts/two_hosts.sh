#!/usr/bin/env bash
# Two "hosts" on one machine (root only): a prefill host and a decode host, each its own
# network, UTS (hostname), IPC and PID namespace, joined by a veth pair. Own IPC/PID/UTS
# namespaces keep UCX from its same-machine shortcuts (shared memory, CMA, cuda_ipc: it tells
# machines apart by hostname and reaches peers' memory through their PIDs), so data crosses
# the link as it would between two machines without RDMA: UCX's log (UCX_PROTO_INFO=y) names
# the pair "inter-node" and a READ "tcp/kvsNd" (with network namespaces alone: "intra-node",
# "cma/memory"; tests/test_two_hosts.py checks both).
#
#   bash scripts/two_hosts.sh up [ID]            make them: prefill 10.77.N.1, decode 10.77.N.2
#   bash scripts/two_hosts.sh run ID ROLE CMD... run CMD on ROLE's host (prefill or decode)
#   bash scripts/two_hosts.sh cut ID | mend ID   take the link down / bring it back
#   bash scripts/two_hosts.sh down ID            remove both
#
# ID (default 0, 0-249) names the namespaces kvshare-ID-prefill / kvshare-ID-decode and picks
# the subnet 10.77.ID.0/24, so several pairs can live side by side. `up` prints the two
# addresses; it fails (exit 2) saying why where namespaces cannot be made (not root, no
# unshare/nsenter, neither `ip` nor Python's pyroute2). Links and namespaces are made with
# `ip` where it is installed, else with pyroute2 (`$PYTHON`, default python3: hosts without
# iproute2); `run` enters with nsenter either way.
set -euo pipefail
cmd=${1:?up, run, cut, mend or down}
id=${2:-0}
[[ "$id" =~ ^[0-9]+$ ]] && [ "$id" -lt 250 ] || { echo "two_hosts: ID is 0-249, not $id" >&2; exit 2; }
ns_p="kvshare-$id-prefill" ns_d="kvshare-$id-decode"
veth_p="kvs${id}p" veth_d="kvs${id}d"
addr_p="10.77.$id.1" addr_d="10.77.$id.2"
PYTHON=${PYTHON:-python3}

# netlink VERB ARGS: one step, through `ip` or else pyroute2.
#   pair NS_P NS_D VETH_P VETH_D ADDR_P ADDR_D | link NS IF up|down | del NS...
netlink() {
  if command -v ip >/dev/null; then netlink_ip "$@"; else "$PYTHON" - "$@" <<'EOF'; fi
import os
import sys

from pyroute2 import IPRoute, NetNS, netns

verb, *args = sys.argv[1:]


def in_ns(name, steps):
    with NetNS(name, flags=0) as ns:
        steps(ns)


def add_ns(name):
    pid = os.fork()  # netns.create moves the calling process into the namespace
    if pid == 0:
        try:
            netns.create(name)
        finally:
            os._exit(0 if name in netns.listnetns() else 1)
    if os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) != 0:
        sys.exit(f"two_hosts: pyroute2 could not create namespace {name}")


if verb == "pair":
    ns_p, ns_d, veth_p, veth_d, addr_p, addr_d = args
    add_ns(ns_p)
    add_ns(ns_d)
    with IPRoute() as ipr:
        ipr.link("add", ifname=veth_p, kind="veth", peer=veth_d)
        for name, ns in ((veth_p, ns_p), (veth_d, ns_d)):
            ipr.link("set", index=ipr.link_lookup(ifname=name)[0], net_ns_fd=ns)
    for ns, veth, addr in ((ns_p, veth_p, addr_p), (ns_d, veth_d, addr_d)):

        def configure(n, veth=veth, addr=addr):
            index = n.link_lookup(ifname=veth)[0]
            n.addr("add", index=index, address=addr, prefixlen=24)
            n.link("set", index=n.link_lookup(ifname="lo")[0], state="up")
            n.link("set", index=index, state="up")

        in_ns(ns, configure)
elif verb == "link":
    ns, veth, state = args
    in_ns(ns, lambda n: n.link("set", index=n.link_lookup(ifname=veth)[0], state=state))
elif verb == "del":
    for ns in args:
        if ns in netns.listnetns():
            netns.remove(ns)
EOF
}

netlink_ip() {
  case "$1" in
    pair)
      local ns_p=$2 ns_d=$3 veth_p=$4 veth_d=$5 addr_p=$6 addr_d=$7
      ip netns add "$ns_p" && ip netns add "$ns_d"
      ip link add "$veth_p" type veth peer name "$veth_d"
      ip link set "$veth_p" netns "$ns_p" && ip link set "$veth_d" netns "$ns_d"
      ip -n "$ns_p" addr add "$addr_p/24" dev "$veth_p"
      ip -n "$ns_d" addr add "$addr_d/24" dev "$veth_d"
      for ns in "$ns_p" "$ns_d"; do ip -n "$ns" link set lo up; done
      ip -n "$ns_p" link set "$veth_p" up && ip -n "$ns_d" link set "$veth_d" up
      ;;
    link) ip -n "$2" link set "$3" "$4" ;;
    del) shift; for ns in "$@"; do ip netns del "$ns" 2>/dev/null || true; done ;;
  esac
}

case "$cmd" in
  up)
    [ "$(id -u)" = 0 ] || { echo "two_hosts: network namespaces need root" >&2; exit 2; }
    for tool in unshare nsenter; do
      command -v "$tool" >/dev/null || { echo "two_hosts: no '$tool' command (util-linux)" >&2; exit 2; }
    done
    command -v ip >/dev/null || "$PYTHON" -c 'import pyroute2' 2>/dev/null || {
      echo "two_hosts: neither an 'ip' command (iproute2) nor Python's pyroute2 ($PYTHON)" >&2
      exit 2
    }
    netlink del "$ns_p" "$ns_d" 2>/dev/null || true
    netlink pair "$ns_p" "$ns_d" "$veth_p" "$veth_d" "$addr_p" "$addr_d" || {
      netlink del "$ns_p" "$ns_d" 2>/dev/null || true
      echo "two_hosts: making the namespaces or their link failed (no CAP_SYS_ADMIN / CAP_NET_ADMIN?)" >&2
      exit 2
    }
    echo "prefill $addr_p decode $addr_d"
    ;;
  run)
    role=${3:?prefill or decode}
    shift 3
    case "$role" in prefill) ns=$ns_p ;; decode) ns=$ns_d ;; *) echo "two_hosts: role $role" >&2; exit 2 ;; esac
    [ -e "/run/netns/$ns" ] || { echo "two_hosts: no namespace $ns (run: $0 up $id)" >&2; exit 2; }
    # --kill-child: the host's processes end with the command (as a machine's would not
    # outlive it here); a fresh /proc shows only this host's PIDs, a fresh /sys only this
    # host's network devices (UCX lists its TCP devices there), as `ip netns exec` shows.
    # /etc/hosts names the host, as a Debian machine's does: a hostname that resolves
    # nowhere held torch's gloo setup ~2 minutes waiting for DNS.
    hosts="${TMPDIR:-/tmp}/kvshare-hosts-$ns"
    printf '127.0.0.1 localhost\n127.0.1.1 %s\n' "$ns" > "$hosts"
    exec nsenter --net="/run/netns/$ns" unshare --uts --ipc --pid --mount --fork --kill-child \
      --mount-proc sh -c 'hostname "$0" && { mount -t sysfs sysfs /sys ||
        echo "two_hosts: could not mount /sys for $0" >&2; } &&
        { mount --bind "$1" /etc/hosts || echo "two_hosts: /etc/hosts not replaced" >&2; } &&
        shift && exec "$@"' "$ns" "$hosts" "$@"
    ;;
  cut) netlink link "$ns_p" "$veth_p" down ;;
  mend) netlink link "$ns_p" "$veth_p" up ;;
  down) netlink del "$ns_p" "$ns_d" ;;
  *) echo "two_hosts: unknown command $cmd" >&2; exit 2 ;;
esac
