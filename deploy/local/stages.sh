#!/usr/bin/env bash
# Start or stop the ocrstream stages in the background (pidfiles and logs in the state dir).
#   stages.sh start         start ingest, dedup, infer, sink, jobs, webhooks (each reused if already running); wait until ready
#   stages.sh start --api   the same, plus the HTTP door (python -m services.api) on
#                           http://127.0.0.1:${OCRSTREAM_HTTP_PORT:-8080} (also: OCRSTREAM_LOCAL_API=1)
#   stages.sh stop          SIGTERM them and the door (each drains and commits), SIGKILL after 30 s
#   stages.sh status        show which are running
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
STATE_DIR="${OCRSTREAM_STATE_DIR:-$ROOT/.state}"
PIDS="$STATE_DIR/pids"; LOGS="$STATE_DIR/logs"
PY="$ROOT/.venv/bin/python"
mkdir -p "$PIDS" "$LOGS"
declare -A PORT=([ingest]=9310 [dedup]=9311 [infer]=9312 [sink]=9313 [jobs]=9314 [webhooks]=9315 [api]="${OCRSTREAM_HTTP_PORT:-8080}")
# the door serves /metrics, /healthz, /readyz on its HTTP port; the stages on their metrics port
declare -A MODULE=([ingest]=services.ingest [dedup]=services.dedup [infer]=services.infer [sink]=services.sink [jobs]=services.jobs
                   [webhooks]=services.webhooks [api]=services.api)
declare -A PORT_VAR=([ingest]=OCRSTREAM_TELEMETRY__METRICS_PORT [dedup]=OCRSTREAM_TELEMETRY__METRICS_PORT
                     [infer]=OCRSTREAM_TELEMETRY__METRICS_PORT [sink]=OCRSTREAM_TELEMETRY__METRICS_PORT
                     [jobs]=OCRSTREAM_TELEMETRY__METRICS_PORT [webhooks]=OCRSTREAM_TELEMETRY__METRICS_PORT
                     [api]=OCRSTREAM_HTTP_PORT)
NAMES=(ingest dedup infer sink jobs webhooks)
if [[ "${2:-}" == "--api" || "${OCRSTREAM_LOCAL_API:-0}" == "1" ]]; then NAMES+=(api); fi
alive() { [[ -f "$PIDS/stage-$1.pid" ]] && kill -0 "$(cat "$PIDS/stage-$1.pid")" 2>/dev/null; }

case "${1:-}" in
  start)
    for st in "${NAMES[@]}"; do
      if alive "$st"; then echo "$st: already running (pid $(cat "$PIDS/stage-$st.pid"))"; continue; fi
      if curl -fsS "http://127.0.0.1:${PORT[$st]}/healthz" >/dev/null 2>&1; then
        echo "$st: port ${PORT[$st]} is already served by a process this script did not start; stop it first"; exit 1
      fi
      rm -f "$PIDS/stage-$st.pid"
      # the stage records its own pid (bash execs python), so stop signals the stage itself
      # exec: no bash waits on the stage holding the caller's stdout (a pipe would never close)
      (cd "$ROOT" && exec env "${PORT_VAR[$st]}=${PORT[$st]}" setsid nohup bash -c \
        'echo $$ >"$0"; exec "$1" -m "$2"' "$PIDS/stage-$st.pid" "$PY" "${MODULE[$st]}" \
        >>"$LOGS/stage-$st.log" 2>&1 </dev/null &)
      for _ in $(seq 1 50); do [[ -s "$PIDS/stage-$st.pid" ]] && break; sleep 0.1; done
      echo "$st: started (pid $(cat "$PIDS/stage-$st.pid")), log $LOGS/stage-$st.log, metrics :${PORT[$st]}"
    done
    for st in "${NAMES[@]}"; do
      for _ in $(seq 1 300); do
        curl -fsS "http://127.0.0.1:${PORT[$st]}/readyz" >/dev/null 2>&1 && break
        alive "$st" || { echo "$st: exited; last log lines:"; tail -n 30 "$LOGS/stage-$st.log"; exit 1; }
        sleep 0.5
      done
      curl -fsS "http://127.0.0.1:${PORT[$st]}/readyz" >/dev/null || { echo "$st: not ready"; exit 1; }
      echo "$st: ready"
    done
    if [[ " ${NAMES[*]} " == *" api "* ]]; then
      echo "api: http://127.0.0.1:${PORT[api]}/ (web page), POST /v1/ocr, the API explorer at /docs (OpenAPI at /openapi.json)"
    fi ;;
  stop)
    for st in api webhooks jobs sink infer dedup ingest; do
      if alive "$st"; then
        pid=$(cat "$PIDS/stage-$st.pid"); kill -TERM "$pid"
        for _ in $(seq 1 60); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
        kill -0 "$pid" 2>/dev/null && kill -KILL "$pid"
        echo "$st: stopped (pid $pid)"
      fi
      rm -f "$PIDS/stage-$st.pid"
    done ;;
  status)
    for st in ingest dedup infer sink jobs webhooks api; do
      if alive "$st"; then echo "$st: running (pid $(cat "$PIDS/stage-$st.pid"))"; else echo "$st: stopped"; fi
    done ;;
  *) echo "usage: $0 start [--api]|stop|status" >&2; exit 2 ;;
esac
