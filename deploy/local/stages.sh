#!/usr/bin/env bash
# Start or stop the four ocrstream stages in the background (pidfiles and logs in the state dir).
#   stages.sh start   start ingest, dedup, infer, sink (each reused if already running); wait until ready
#   stages.sh stop    SIGTERM them (each drains its batch and commits), SIGKILL after 30 s
#   stages.sh status  show which are running
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
STATE_DIR="${OCRSTREAM_STATE_DIR:-$ROOT/.state}"
PIDS="$STATE_DIR/pids"; LOGS="$STATE_DIR/logs"
PY="$ROOT/.venv/bin/python"
mkdir -p "$PIDS" "$LOGS"
declare -A PORT=([ingest]=9310 [dedup]=9311 [infer]=9312 [sink]=9313)
alive() { [[ -f "$PIDS/stage-$1.pid" ]] && kill -0 "$(cat "$PIDS/stage-$1.pid")" 2>/dev/null; }

case "${1:-}" in
  start)
    for st in ingest dedup infer sink; do
      if alive "$st"; then echo "$st: already running (pid $(cat "$PIDS/stage-$st.pid"))"; continue; fi
      if curl -fsS "http://127.0.0.1:${PORT[$st]}/healthz" >/dev/null 2>&1; then
        echo "$st: port ${PORT[$st]} is already served by a process this script did not start; stop it first"; exit 1
      fi
      rm -f "$PIDS/stage-$st.pid"
      # the stage records its own pid (bash execs python), so stop signals the stage itself
      (cd "$ROOT" && OCRSTREAM_TELEMETRY__METRICS_PORT="${PORT[$st]}" setsid nohup bash -c \
        'echo $$ >"$0"; exec "$1" -m "services.$2"' "$PIDS/stage-$st.pid" "$PY" "$st" \
        >>"$LOGS/stage-$st.log" 2>&1 </dev/null &)
      for _ in $(seq 1 50); do [[ -s "$PIDS/stage-$st.pid" ]] && break; sleep 0.1; done
      echo "$st: started (pid $(cat "$PIDS/stage-$st.pid")), log $LOGS/stage-$st.log, metrics :${PORT[$st]}"
    done
    for st in ingest dedup infer sink; do
      for _ in $(seq 1 300); do
        curl -fsS "http://127.0.0.1:${PORT[$st]}/readyz" >/dev/null 2>&1 && break
        alive "$st" || { echo "$st: exited; last log lines:"; tail -n 30 "$LOGS/stage-$st.log"; exit 1; }
        sleep 0.5
      done
      curl -fsS "http://127.0.0.1:${PORT[$st]}/readyz" >/dev/null || { echo "$st: not ready"; exit 1; }
      echo "$st: ready"
    done ;;
  stop)
    for st in sink infer dedup ingest; do
      if alive "$st"; then
        pid=$(cat "$PIDS/stage-$st.pid"); kill -TERM "$pid"
        for _ in $(seq 1 60); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
        kill -0 "$pid" 2>/dev/null && kill -KILL "$pid"
        echo "$st: stopped (pid $pid)"
      fi
      rm -f "$PIDS/stage-$st.pid"
    done ;;
  status)
    for st in ingest dedup infer sink; do
      if alive "$st"; then echo "$st: running (pid $(cat "$PIDS/stage-$st.pid"))"; else echo "$st: stopped"; fi
    done ;;
  *) echo "usage: $0 start|stop|status" >&2; exit 2 ;;
esac
