#!/usr/bin/env bash
# Background jobs on the GPU host, across device calls. A call's processes end when it returns,
# except those in a new session (setsid), which run while the host stays warm. So one GPU step
# runs while later calls carry the next stack's parts, and a later call collects what it wrote.
#
#   bash lab/gpu/bg.sh start NAME 'CMD'   CMD (a bash line) from a copy of this tree, with
#                                             OUT=/tmp/bg/NAME/out; its output in /tmp/bg/NAME/log
#   bash lab/gpu/bg.sh wait NAME [S]      until NAME ends or S s (default 540) have passed
#   bash lab/gpu/bg.sh collect NAME [S]   wait, then NAME's out and log as $OUT/NAME.tgz
#   bash lab/gpu/bg.sh stop NAME [S]      SIGTERM to NAME's session, then wait up to S s (60)
#   bash lab/gpu/bg.sh status             a line per job: running, or its exit status
#
# The copy leaves out the stacks' parts (.gpu/cNN, .gpu033/cNN, .gpu034/cNN): a job never reads
# them, and a later call that carries other parts must not change the tree a running job
# imports from.
set -u
BG=/tmp/bg
cmd=${1:?start, stop, wait, collect or status}
name=${2:-}
job=$BG/$name

state() {  # NAME: running, exit N, or unknown
  if [ -f "$BG/$1/rc" ]; then echo "exit $(cat "$BG/$1/rc")"
  elif [ -f "$BG/$1/pid" ] && kill -0 "$(cat "$BG/$1/pid")" 2>/dev/null; then echo running
  else echo unknown; fi
}

wait_for() {  # NAME S
  local t=0
  while [ "$(state "$1")" = running ] && [ "$t" -lt "$2" ]; do sleep 2; t=$((t + 2)); done
  echo "bg $1: $(state "$1") after $t s of waiting"
}

case "$cmd" in
  start)
    [ -n "$name" ] && [ -n "${3:-}" ] || { echo "usage: bg.sh start NAME 'CMD'" >&2; exit 2; }
    [ "$(state "$name")" = running ] && { echo "bg $name: already running" >&2; exit 2; }
    rm -rf "$job" && mkdir -p "$job/tree" "$job/out"
    tar cf - --exclude='./.gpu/c[0-9]*' --exclude='./.gpu033/c[0-9]*' \
      --exclude='./.gpu034/c[0-9]*' --exclude=./.git --exclude='./.venv*' --exclude=./results . \
      | tar xf - -C "$job/tree"
    # The job writes its own pid: under job control (the device runner's `set -m`) setsid
    # forks, and the pid of the process started here is gone at once.
    (cd "$job/tree" && OUT="$job/out" setsid bash -c "echo \$\$ > '$job/pid'; $3; echo \$? > '$job/rc'" \
      > "$job/log" 2>&1 < /dev/null &)
    echo "bg $name: started ($3)"
    ;;
  stop)  # SIGTERM to the job's session (bench_serving stops its engines on it), then wait
    pid=$(cat "$job/pid" 2>/dev/null) && kill -TERM -- "-$pid" 2>/dev/null
    wait_for "$name" "${3:-60}"
    ;;
  wait) wait_for "$name" "${3:-540}"; tail -n 20 "$job/log" 2>/dev/null ;;
  collect)
    : "${OUT:?set OUT}"
    wait_for "$name" "${3:-540}"
    tail -n 20 "$job/log" 2>/dev/null
    tar czf "$OUT/$name.tgz" -C "$job" out log
    ;;
  status) for d in "$BG"/*/; do [ -d "$d" ] && echo "bg $(basename "$d"): $(state "$(basename "$d")")"; done ;;
  *) echo "bg.sh: start, stop, wait, collect or status, not $cmd" >&2; exit 2 ;;
esac
