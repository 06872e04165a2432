#!/usr/bin/env bash
# Start one `gyre worker` per device set on this GPU host (one worker = one cell), in the background,
# each logging to its own file. Stop them with infra/worker-gpu-stop.sh.
#
#   infra/worker-gpu.sh API_URL POOL QUEUES DEVICES [DEVICES ...]
#   infra/worker-gpu.sh http://10.0.0.5:4200/api gyre rollout,train 0,1 2,3 4,5 6,7
#
#   API_URL  the Prefect API of the control host (PREFECT_API_URL)
#   POOL     the work pool (it and the queues must exist: `gyre up` or ensure_pools on the control host)
#   QUEUES   comma-separated queues each worker polls; cells poll `rollout,train` (capacity moves between
#            them through the queues' concurrency limits; a running worker cannot change its queues)
#   DEVICES  one CUDA_VISIBLE_DEVICES value per worker, e.g. `0,1`; `none` hides every GPU (CPU work)
#
# Environment (export it, or put it in infra/gpu-host.env, which is read if present; see docs/operations.md):
#   GYRE_HOME              project checkout on this host (default: this script's ..); flow runs start there
#   GYRE_PYTHON            its Python (default: $GYRE_HOME/.venv/bin/python)
#   GYRE_LOG_DIR           logs and pid files (default: $GYRE_HOME/data/workers)
#   GYRE_WORKER_PREFIX     worker name prefix (default: the short host name)
#   MLFLOW_TRACKING_URI    default: http://<API host>:5000
#   AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY   the S3 store's keys (the lake on s3://)
#   AWS_ENDPOINT_URL       the S3 store (default: http://<API host>:9000)
#   PREFECT_API_AUTH_STRING  user:password when the server has basic auth (the compose file turns it on)
set -euo pipefail

usage() { sed -n '2,22p' "$0" | sed 's/^# \{0,1\}//'; }
case "${1:-}" in -h|--help) usage; exit 0 ;; esac
if [ "$#" -lt 4 ]; then
  echo "worker-gpu.sh: need API_URL POOL QUEUES and at least one DEVICES set (got $# argument(s))" >&2
  usage >&2
  exit 2
fi
API_URL=$1 POOL=$2 QUEUES=$3
shift 3
DEVICE_SETS=("$@")

GYRE_HOME=${GYRE_HOME:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}
ENV_FILE=${GYRE_ENV_FILE:-$GYRE_HOME/infra/gpu-host.env}
if [ -f "$ENV_FILE" ]; then
  set -a; . "$ENV_FILE"; set +a
fi
PY=${GYRE_PYTHON:-$GYRE_HOME/.venv/bin/python}
LOG_DIR=${GYRE_LOG_DIR:-$GYRE_HOME/data/workers}
PREFIX=${GYRE_WORKER_PREFIX:-$(hostname -s 2>/dev/null || hostname)}
if [ ! -x "$PY" ]; then
  echo "worker-gpu.sh: no Python at $PY (set GYRE_PYTHON, or create the venv in $GYRE_HOME)" >&2
  exit 2
fi
case "$API_URL" in
  http://*|https://*) ;;
  *) echo "worker-gpu.sh: API_URL must look like http://HOST:4200/api, got '$API_URL'" >&2; exit 2 ;;
esac
API_HOST=${API_URL#*://}; API_HOST=${API_HOST%%/*}; API_HOST=${API_HOST%:*}

export GYRE_HOME PREFECT_API_URL="$API_URL"
export MLFLOW_TRACKING_URI=${MLFLOW_TRACKING_URI:-http://$API_HOST:5000}
export AWS_ENDPOINT_URL=${AWS_ENDPOINT_URL:-http://$API_HOST:9000}
export PREFECT_FLOWS_HEARTBEAT_FREQUENCY=${PREFECT_FLOWS_HEARTBEAT_FREQUENCY:-30}
export DO_NOT_TRACK=1
if [ -z "${AWS_ACCESS_KEY_ID:-}" ] || [ -z "${AWS_SECRET_ACCESS_KEY:-}" ]; then
  echo "worker-gpu.sh: warning: AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY are not set; runs cannot use an s3:// lake" >&2
fi

QUEUE_ARGS=()
IFS=',' read -r -a QLIST <<< "$QUEUES"
for q in "${QLIST[@]}"; do
  [ -n "$q" ] && QUEUE_ARGS+=(--queue "$q")
done
if [ "${#QUEUE_ARGS[@]}" -eq 0 ]; then
  echo "worker-gpu.sh: QUEUES is empty" >&2
  exit 2
fi
mkdir -p "$LOG_DIR"
cd "$GYRE_HOME"

tag() { local t=${1//,/-}; echo "${t:-none}"; }

# 1. check everything before starting anything: the server, the pool and queues, each device set
for devs in "${DEVICE_SETS[@]}"; do
  pidfile=$LOG_DIR/worker-$(tag "$devs").pid
  if [ -f "$pidfile" ] && kill -0 "$(cat "$pidfile")" 2>/dev/null; then
    echo "worker-gpu.sh: a worker for devices $devs is already running (pid $(cat "$pidfile")); stop it first" >&2
    exit 2
  fi
  "$PY" -m gyre_cli worker --pool "$POOL" "${QUEUE_ARGS[@]}" --devices "$devs" --name "$PREFIX" --dry-run \
    > /dev/null || exit $?
done

# 2. start them (`gyre worker` execs the Prefect worker: the pid below is the worker's own)
PIDS=()
for devs in "${DEVICE_SETS[@]}"; do
  t=$(tag "$devs")
  log=$LOG_DIR/worker-$t.log
  echo "=== $(date -u +%Y-%m-%dT%H:%M:%SZ) start devices=$devs pool=$POOL queues=$QUEUES" >> "$log"
  nohup "$PY" -m gyre_cli worker --pool "$POOL" "${QUEUE_ARGS[@]}" --devices "$devs" --name "$PREFIX" \
    >> "$log" 2>&1 < /dev/null &
  echo $! > "$LOG_DIR/worker-$t.pid"
  PIDS+=("$!")
done

# 3. report: each worker either says it started or has exited (then show why)
failed=0
for i in "${!DEVICE_SETS[@]}"; do
  devs=${DEVICE_SETS[$i]} pid=${PIDS[$i]} log=$LOG_DIR/worker-$(tag "${DEVICE_SETS[$i]}").log
  for _ in $(seq "${GYRE_START_WAIT:-120}"); do
    if grep -q "started!" <(tail -n 20 "$log"); then break; fi
    kill -0 "$pid" 2>/dev/null || break
    sleep 1
  done
  if kill -0 "$pid" 2>/dev/null; then
    echo "worker for devices $devs: pid $pid, log $log"
  else
    echo "worker for devices $devs exited; last lines of $log:" >&2
    tail -n 5 "$log" >&2
    rm -f "$LOG_DIR/worker-$(tag "$devs").pid"
    failed=1
  fi
done
exit $failed
