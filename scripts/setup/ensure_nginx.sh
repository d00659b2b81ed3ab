#!/usr/bin/env bash
# Make sure `nginx` is on PATH (Debian's package), for the affinity-routing
# test (a real proxy in front of two engines). Does nothing when present.
set -euo pipefail
if command -v nginx >/dev/null 2>&1 || [ -x /usr/sbin/nginx ]; then
  exit 0
fi
sudo=""
if [ "$(id -u)" != "0" ]; then sudo="sudo"; fi
echo "ensure_nginx: installing Debian's nginx package"
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get install -y -q nginx-light >/dev/null 2>&1 || $sudo apt-get install -y -q nginx >/dev/null 2>&1 || {
  $sudo apt-get update -q >/dev/null 2>&1
  $sudo apt-get install -y -q nginx >/dev/null
}
# The package may start the system service; tests run their own on loopback.
$sudo service nginx stop >/dev/null 2>&1 || $sudo pkill -x nginx >/dev/null 2>&1 || true
command -v nginx >/dev/null 2>&1 || [ -x /usr/sbin/nginx ]
