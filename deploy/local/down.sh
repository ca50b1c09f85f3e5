#!/usr/bin/env bash
# deploy/local/down.sh [--purge] [SERVICE...] -- stop what up.sh started.
#
# SERVICES: kafka redis mariadb s3 (default: all, and the stages of stages.sh first). Only pids recorded by up.sh
# in $STATE_DIR/pids are signalled: SIGTERM, up to 30 s grace, then SIGKILL.
# Data stays in place unless --purge: then the whole state dir is deleted
# (or, with SERVICE arguments, just those services' data and logs).
set -euo pipefail
# shellcheck source=deploy/local/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

purge=""
args=()
for a in "$@"; do
  case "$a" in
    --purge) purge=1 ;;
    -h|--help) sed -n '2,7p' "$0"; exit 0 ;;
    *) args+=("$a") ;;
  esac
done
parse_services "${args[@]+"${args[@]}"}"

stop_service() {
  local svc="$1" pid t0=$SECONDS
  if ! pid="$(running_pid "$svc")"; then
    rm -f "$(pidfile "$svc")"
    log "$svc" "not running"
    return
  fi
  kill -TERM "$pid" 2>/dev/null || true
  while kill -0 "$pid" 2>/dev/null && ((SECONDS - t0 < 30)); do sleep 0.5; done
  if kill -0 "$pid" 2>/dev/null; then
    kill -KILL "$pid" 2>/dev/null || true
    log "$svc" "did not stop within 30s: sent SIGKILL to pid $pid"
  else
    log "$svc" "stopped (pid $pid, $((SECONDS - t0))s)"
  fi
  rm -f "$(pidfile "$svc")"
}

# The ocrstream stages first (when stopping everything), so they drain and commit while Kafka is up.
if ((${#args[@]} == 0)); then bash "$(dirname "${BASH_SOURCE[0]}")/stages.sh" stop; fi

# Stop in reverse start order.
for ((i = ${#SERVICES[@]} - 1; i >= 0; i--)); do stop_service "${SERVICES[i]}"; done

if [[ -n $purge ]]; then
  [[ -n $STATE_DIR && $STATE_DIR != / && $STATE_DIR != "$HOME" ]] || die down "refusing to purge '$STATE_DIR'"
  if ((${#args[@]} == 0)); then
    rm -rf "$STATE_DIR"
    echo "purge: deleted $STATE_DIR"
  else
    for svc in "${SERVICES[@]}"; do
      rm -rf "${STATE_DIR:?}/$svc" "$LOG_DIR/$svc".* "$LOG_DIR/$svc"-*
      echo "purge: deleted $STATE_DIR/$svc and its logs"
    done
  fi
fi
