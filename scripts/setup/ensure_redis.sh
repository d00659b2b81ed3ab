#!/usr/bin/env bash
# Make sure `redis-server` is installed (Debian's package), for the
# shared-budget tests and the fleet simulation. Does nothing when present.
set -euo pipefail
if command -v redis-server >/dev/null 2>&1 || [ -x /usr/bin/redis-server ]; then
  exit 0
fi
sudo=""
if [ "$(id -u)" != "0" ]; then sudo="sudo"; fi
echo "ensure_redis: installing Debian's redis-server package"
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get install -y -q redis-server >/dev/null 2>&1 || {
  $sudo apt-get update -q >/dev/null 2>&1
  $sudo apt-get install -y -q redis-server >/dev/null
}
# The package starts the system service; tests run their own on loopback.
$sudo service redis-server stop >/dev/null 2>&1 || $sudo pkill -x redis-server >/dev/null 2>&1 || true
command -v redis-server >/dev/null 2>&1 || [ -x /usr/bin/redis-server ]
