#!/usr/bin/env bash
# Two "hosts" on one machine (root only): a prefill host and a decode host, each its own
# network, UTS (hostname), IPC and PID namespace, joined by a veth pair. Own IPC/PID/UTS
# namespaces keep UCX from its same-machine shortcuts (shared memory, CMA, cuda_ipc: it tells
# machines apart by hostname and reaches peers' memory through their PIDs), so data crosses
# the link as it would between two machines without RDMA.
#
#   bash scripts/two_hosts.sh up [ID]            make them: prefill 10.77.N.1, decode 10.77.N.2
#   bash scripts/two_hosts.sh run ID ROLE CMD... run CMD on ROLE's host (prefill or decode)
#   bash scripts/two_hosts.sh cut ID | mend ID   take the link down / bring it back
#   bash scripts/two_hosts.sh down ID            remove both
#
# ID (default 0, 0-249) names the namespaces kvshare-ID-prefill / kvshare-ID-decode and picks
# the subnet 10.77.ID.0/24, so several pairs can live side by side. `up` prints the two
# addresses; it fails (exit 2) saying why where namespaces cannot be made (not root, no `ip`).
set -euo pipefail
cmd=${1:?up, run, cut, mend or down}
id=${2:-0}
[[ "$id" =~ ^[0-9]+$ ]] && [ "$id" -lt 250 ] || { echo "two_hosts: ID is 0-249, not $id" >&2; exit 2; }
ns_p="kvshare-$id-prefill" ns_d="kvshare-$id-decode"
veth_p="kvs${id}p" veth_d="kvs${id}d"
addr_p="10.77.$id.1" addr_d="10.77.$id.2"

case "$cmd" in
  up)
    command -v ip >/dev/null || { echo "two_hosts: no 'ip' command (iproute2)" >&2; exit 2; }
    [ "$(id -u)" = 0 ] || { echo "two_hosts: network namespaces need root" >&2; exit 2; }
    "$0" down "$id" 2>/dev/null || true
    ip netns add "$ns_p" && ip netns add "$ns_d" ||
      { echo "two_hosts: 'ip netns add' failed (no CAP_SYS_ADMIN?)" >&2; exit 2; }
    ip link add "$veth_p" type veth peer name "$veth_d"
    ip link set "$veth_p" netns "$ns_p" && ip link set "$veth_d" netns "$ns_d"
    ip -n "$ns_p" addr add "$addr_p/24" dev "$veth_p"
    ip -n "$ns_d" addr add "$addr_d/24" dev "$veth_d"
    for ns in "$ns_p" "$ns_d"; do ip -n "$ns" link set lo up; done
    ip -n "$ns_p" link set "$veth_p" up && ip -n "$ns_d" link set "$veth_d" up
    echo "prefill $addr_p decode $addr_d"
    ;;
  run)
    role=${3:?prefill or decode}
    shift 3
    case "$role" in prefill) ns=$ns_p ;; decode) ns=$ns_d ;; *) echo "two_hosts: role $role" >&2; exit 2 ;; esac
    # --kill-child: the host's processes end with the command (as a machine's would not
    # outlive it here); a fresh /proc shows only this host's PIDs.
    exec ip netns exec "$ns" unshare --uts --ipc --pid --mount --fork --kill-child \
      --mount-proc sh -c 'hostname "$0" && exec "$@"' "$ns" "$@"
    ;;
  cut) ip -n "$ns_p" link set "$veth_p" down ;;
  mend) ip -n "$ns_p" link set "$veth_p" up ;;
  down)
    ip netns del "$ns_p" 2>/dev/null || true
    ip netns del "$ns_d" 2>/dev/null || true
    ;;
  *) echo "two_hosts: unknown command $cmd" >&2; exit 2 ;;
esac
