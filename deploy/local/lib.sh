# shellcheck shell=bash disable=SC2034  # variables are used by up.sh/down.sh
# deploy/local/lib.sh -- shared settings and helpers for up.sh / down.sh.
#
# Sourced, not executed. Defines the state/cache layout, ports, pinned
# versions and small process/port helpers. Everything here binds to
# 127.0.0.1 and only ever signals pids recorded in $PID_DIR.

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
DEPLOY_DIR="$REPO_ROOT/deploy/local"

STATE_DIR="${OCRSTREAM_STATE_DIR:-$REPO_ROOT/.state}"
mkdir -p "$STATE_DIR"
STATE_DIR="$(cd "$STATE_DIR" && pwd)"          # absolute
PID_DIR="$STATE_DIR/pids"
LOG_DIR="$STATE_DIR/logs"
# Built/downloaded artefacts that are not data (minio binary); survives --purge.
CACHE_DIR="${OCRSTREAM_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/ocrstream}"

KAFKA_PORT="${OCRSTREAM_KAFKA_PORT:-9092}"
KAFKA_CONTROLLER_PORT="${OCRSTREAM_KAFKA_CONTROLLER_PORT:-9093}"
REDIS_PORT="${OCRSTREAM_REDIS_PORT:-6379}"
MYSQL_PORT="${OCRSTREAM_MYSQL_PORT:-3306}"
S3_PORT="${OCRSTREAM_S3_PORT:-9000}"
S3_CONSOLE_PORT="${OCRSTREAM_S3_CONSOLE_PORT:-9001}"
READY_TIMEOUT="${OCRSTREAM_READY_TIMEOUT:-60}"   # seconds per service

KAFKA_VERSION="4.1.1"   # keep in sync with deploy/local/kafka/pom.xml
# MinIO tags (RELEASE.*) are not semver, so Go resolves them to a pseudo-version.
# This is what `go install github.com/minio/minio@latest` resolved to on
# 2026-11-29 and was verified with the stack (see docs/setup.md).
MINIO_MODULE="github.com/minio/minio"
MINIO_VERSION="${OCRSTREAM_MINIO_VERSION:-v0.0.0-20260212201848-7aac2a2c5b7c}"
MINIO_BIN="$CACHE_DIR/bin/minio"

S3_ACCESS_KEY="ocrstream"
S3_SECRET_KEY="ocrstream-secret"
DB_NAME="ocrstream"; DB_USER="ocrstream"; DB_PASSWORD="ocrstream"

ALL_SERVICES=(kafka redis mariadb s3)

log()  { printf '%s: %s\n' "$1" "${*:2}"; }
die()  { printf '%s: ERROR: %s\n' "$1" "${*:2}" >&2; exit 1; }

# Resolve the argument list to services (default: all); reject unknown names.
parse_services() {
  SERVICES=()
  local s
  [[ $# -eq 0 ]] && { SERVICES=("${ALL_SERVICES[@]}"); return; }
  for s in "$@"; do
    [[ " ${ALL_SERVICES[*]} " == *" $s "* ]] || die "$(basename "$0")" "unknown service '$s' (known: ${ALL_SERVICES[*]})"
    SERVICES+=("$s")
  done
}

# Substring that must appear in /proc/<pid>/cmdline for the pid to count as ours
# (guards against pid reuse after a reboot).
cmd_marker() {
  case "$1" in
    kafka)   echo "kafka.Kafka" ;;
    redis)   echo "redis-server" ;;
    mariadb) echo "mariadbd" ;;
    s3)      echo "minio" ;;
  esac
}

pidfile() { echo "$PID_DIR/$1.pid"; }

# Print the pid up.sh recorded for service $1 (a number), else fail.
recorded_pid() {
  local f pid
  f="$(pidfile "$1")"
  [[ -s $f ]] || return 1
  pid="$(<"$f")"
  [[ $pid =~ ^[0-9]+$ ]] || return 1
  echo "$pid"
}

# Print the pid of a live process started by up.sh for service $1, else fail.
running_pid() {
  local pid
  pid="$(recorded_pid "$1")" && kill -0 "$pid" 2>/dev/null || return 1
  local cmdline
  cmdline="$(tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null)" || return 1
  [[ $cmdline == *"$(cmd_marker "$1")"* ]] || return 1
  echo "$pid"
}

# Start "$@" detached (own session, immune to SIGHUP), stdout+stderr -> $2,
# and record its pid. nohup/setsid exec the command, so $! is the daemon itself.
# fd 9 (up.sh's lock) is closed so daemons do not hold the lock forever.
start_detached() {
  local svc="$1" out="$2"; shift 2
  mkdir -p "$PID_DIR" "$(dirname "$out")"
  setsid nohup "$@" >>"$out" 2>&1 </dev/null 9>&- &
  echo $! >"$(pidfile "$svc")"
}

port_open() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

# Fail if something not started by us listens on the port.
require_port_free() {
  local svc="$1" port="$2" who
  port_open "$port" || return 0
  who="$(ss -Htlnp "sport = :$port" 2>/dev/null | grep -o 'users:(.*)' | head -1)"
  local pid owner=""
  pid="$(grep -o 'pid=[0-9]*' <<<"$who" | head -1 | cut -d= -f2)"
  if [[ -n "$pid" && -r "/proc/$pid/cmdline" ]]; then  # a stack started by another clone names its state folder
    owner="$( { tr '\0' '\n' <"/proc/$pid/cmdline"; readlink "/proc/$pid/cwd"; } 2>/dev/null \
      | grep -o '/[^ :=]*/\.state' | head -1)"
  fi
  if [[ -n "$owner" && "$owner" != "$STATE_DIR" ]]; then
    die "$svc" "port $port is in use by the local stack of another clone (state folder $owner); one machine runs one stack." \
      "Stop it from that clone (bash deploy/local/down.sh there), or use it from here: export OCRSTREAM_STATE_DIR=$owner"
  fi
  # shellcheck disable=SC2016
  die "$svc" "port $port is already in use by another process: ${who:-unknown (run: ss -ltnp 'sport = :$port')}." \
    "Stop it or set the matching OCRSTREAM_*_PORT variable."
}

http_ok() {
  if command -v curl >/dev/null; then
    curl -fsS -m 2 -o /dev/null "$1" 2>/dev/null
  else
    python3 -c 'import sys,urllib.request; urllib.request.urlopen(sys.argv[1], timeout=2)' "$1" 2>/dev/null
  fi
}

# started_alive SVC: true while the process start_detached recorded for SVC lives (a zombie is dead).
# Unlike running_pid it does not check the command line: between fork and exec it is still this
# script's, and on 2 busy cores that window was long enough to read as "exited during start-up".
started_alive() {
  local pid stat
  pid="$(recorded_pid "$1")" || return 1
  { read -r stat <"/proc/$pid/stat"; } 2>/dev/null || return 1  # not $(<...): under set -e a failed one ends the script
  stat="${stat##*) }"          # the fields after "(comm) "; comm may hold spaces
  [[ ${stat%% *} != Z ]]       # state: Z = exited, not yet reaped
}

# wait_ready SVC LOGFILE CHECK... : poll CHECK (a command) until it succeeds,
# the process dies, or READY_TIMEOUT passes; on failure show the log tail.
wait_ready() {
  local svc="$1" logf="$2"; shift 2
  local deadline=$((SECONDS + READY_TIMEOUT))
  while ! "$@"; do
    if ! started_alive "$svc"; then
      echo "$svc: process exited during start-up; last lines of $logf:" >&2
      tail -n 40 "$logf" >&2 || true
      exit 1
    fi
    if ((SECONDS >= deadline)); then
      echo "$svc: not ready after ${READY_TIMEOUT}s; last lines of $logf:" >&2
      tail -n 40 "$logf" >&2 || true
      exit 1
    fi
    sleep 0.5
  done
}

# apt-get install the given packages (update first); only called when a binary is missing.
apt_install() {
  local svc="$1"; shift
  command -v apt-get >/dev/null || die "$svc" "missing binaries and no apt-get; install: $*"
  local sudo=""; [[ $EUID -ne 0 ]] && sudo="sudo"
  log "$svc" "installing $* (apt-get)"
  # Keep the packages' own system services (redis on 6379, mariadb on 3306)
  # from auto-starting during install: they would take our ports. policy-rc.d
  # exit 101 = "action forbidden"; only added if none exists, removed after.
  local policy=/usr/sbin/policy-rc.d added=""
  if [[ ! -e $policy ]]; then
    printf '#!/bin/sh\nexit 101\n' | $sudo tee "$policy" >/dev/null && $sudo chmod 755 "$policy" && added=1
  fi
  local rc=0
  { $sudo apt-get update -qq &&
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "$@" >/dev/null; } || rc=$?
  [[ -n $added ]] && $sudo rm -f "$policy"
  ((rc == 0)) || die "$svc" "apt-get install $* failed (rc=$rc)"
}
