#!/usr/bin/env bash
# A private Docker engine for machines without one (make images / make compose-test use it when DOCKER_HOST is
# unset and no engine answers on the default socket):
#
#     eval "$(scripts/dockerd.sh start)"     # starts it if needed; prints `export DOCKER_HOST=unix://...`
#     scripts/dockerd.sh stop
#     scripts/dockerd.sh status               # exit 0 while it answers
#
# Its data root, exec root, socket, pid file and log live under DEEPINFER_DOCKER_ROOT (default
# /var/tmp/deepinfer-docker), never in the system's /var/lib/docker. Started as root with the vfs storage driver,
# no iptables and no bridge: it runs where overlayfs and netfilter are not available (nested containers, CI
# runners); containers then use the host's network (`network_mode: host`, docker/compose.host.yml).
set -euo pipefail
ROOT=${DEEPINFER_DOCKER_ROOT:-/var/tmp/deepinfer-docker}
SOCKET=$ROOT/docker.sock
PIDFILE=$ROOT/dockerd.pid
export DOCKER_HOST=unix://$SOCKET

answers() { docker version --format '{{.Server.Version}}' > /dev/null 2>&1; }

case "${1:-}" in
  start)
    if ! answers; then
        command -v dockerd > /dev/null || { echo "dockerd.sh: no dockerd (apt-get install docker.io)" >&2; exit 2; }
        [ "$(id -u)" = 0 ] || { echo "dockerd.sh: dockerd needs root" >&2; exit 2; }
        mkdir -p "$ROOT/data" "$ROOT/exec"
        nohup dockerd --data-root "$ROOT/data" --exec-root "$ROOT/exec" --host "$DOCKER_HOST" \
            --pidfile "$PIDFILE" --storage-driver vfs --iptables=false --bridge=none \
            > "$ROOT/dockerd.log" 2>&1 &
        for _ in $(seq 60); do
            answers && break
            kill -0 $! 2> /dev/null || { echo "dockerd.sh: dockerd exited; see $ROOT/dockerd.log" >&2; exit 1; }
            sleep 0.5
        done
        answers || { echo "dockerd.sh: no answer in 30 s; see $ROOT/dockerd.log" >&2; exit 1; }
    fi
    echo "export DOCKER_HOST=$DOCKER_HOST" ;;
  stop)
    if [ -f "$PIDFILE" ]; then
        pid=$(cat "$PIDFILE")
        kill "$pid" 2> /dev/null || true
        for _ in $(seq 60); do kill -0 "$pid" 2> /dev/null || break; sleep 0.5; done
    fi ;;
  status)
    answers ;;
  *)
    echo "usage: $0 start|stop|status" >&2
    exit 2 ;;
esac
