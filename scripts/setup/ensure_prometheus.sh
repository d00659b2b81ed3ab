#!/usr/bin/env bash
# Make sure `prometheus` and `promtool` are on PATH (Debian's package), for the
# rule tests and the dashboard integration test. Does nothing when present.
set -euo pipefail
if command -v prometheus >/dev/null 2>&1 && command -v promtool >/dev/null 2>&1; then
  exit 0
fi
sudo=""
if [ "$(id -u)" != "0" ]; then sudo="sudo"; fi
echo "ensure_prometheus: installing Debian's prometheus package (prometheus + promtool)"
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get install -y -q prometheus >/dev/null 2>&1 || {
  $sudo apt-get update -q >/dev/null 2>&1
  $sudo apt-get install -y -q prometheus >/dev/null
}
# The package may try to start a service; tests start their own on loopback.
$sudo pkill -x prometheus >/dev/null 2>&1 || true
command -v promtool >/dev/null
