#!/usr/bin/env bash
# Stop the workers infra/worker-gpu.sh started on this host (by their pid files), and by default the flow
# runs they started (a Prefect worker that stops leaves its flow-run processes running).
#
#   infra/worker-gpu-stop.sh [--keep-runs] [LOG_DIR]
#
# LOG_DIR defaults to $GYRE_LOG_DIR or $GYRE_HOME/data/workers. Each worker (and its runs) gets SIGTERM;
# whatever is still there after GYRE_STOP_GRACE seconds (default 30) gets a second SIGTERM (Prefect's
# worker then kills itself) and its runs SIGKILL. Only processes named by the pid files, and their
# descendants, are signalled.
set -euo pipefail

KEEP_RUNS=0
if [ "${1:-}" = "--keep-runs" ]; then KEEP_RUNS=1; shift; fi
case "${1:-}" in -h|--help) sed -n '2,10p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;; esac
GYRE_HOME=${GYRE_HOME:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}
LOG_DIR=${1:-${GYRE_LOG_DIR:-$GYRE_HOME/data/workers}}
GRACE=${GYRE_STOP_GRACE:-30}

descendants() {          # every descendant pid of $1, children first
  local c
  for c in $(pgrep -P "$1" 2>/dev/null || true); do
    echo "$c"
    descendants "$c"
  done
}

shopt -s nullglob
WORKERS=() RUNS=()
for pidfile in "$LOG_DIR"/worker-*.pid; do
  pid=$(cat "$pidfile")
  if kill -0 "$pid" 2>/dev/null && tr '\0' ' ' < "/proc/$pid/cmdline" 2>/dev/null | grep -q "worker start"; then
    WORKERS+=("$pid")
    [ "$KEEP_RUNS" = 1 ] || RUNS+=($(descendants "$pid"))
  else
    echo "$(basename "$pidfile"): pid $pid is not a running worker; removing the pid file"
    rm -f "$pidfile"
  fi
done
if [ "${#WORKERS[@]}" -eq 0 ]; then
  echo "no running workers under $LOG_DIR"
  exit 0
fi

echo "stopping ${#WORKERS[@]} worker(s) (${WORKERS[*]})${RUNS[*]:+ and their runs (${RUNS[*]})}"
kill -TERM "${RUNS[@]}" "${WORKERS[@]}" 2>/dev/null || true
alive() { local p n=0; for p in "$@"; do kill -0 "$p" 2>/dev/null && n=$((n + 1)); done; echo $n; }
for _ in $(seq "$GRACE"); do
  [ "$(alive "${WORKERS[@]}" "${RUNS[@]}")" -eq 0 ] && break
  sleep 1
done
left=$(alive "${WORKERS[@]}" "${RUNS[@]}")
if [ "$left" -gt 0 ]; then
  echo "$left process(es) still running after ${GRACE}s: forcing"
  for p in "${WORKERS[@]}"; do kill -TERM "$p" 2>/dev/null || true; done   # the worker's own SIGKILL
  for p in "${RUNS[@]}"; do kill -KILL "$p" 2>/dev/null || true; done
  sleep 2
fi
for pidfile in "$LOG_DIR"/worker-*.pid; do
  kill -0 "$(cat "$pidfile")" 2>/dev/null || rm -f "$pidfile"
done
left=$(alive "${WORKERS[@]}" "${RUNS[@]}")
[ "$left" -eq 0 ] && echo "stopped" || { echo "$left process(es) did not stop" >&2; exit 1; }
