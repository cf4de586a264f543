#!/usr/bin/env bash
# Debian packages the tests drive as real servers and clients: nginx (a reverse
# proxy in front of the edge, and the edge benchmark's baseline), redis-server
# (stream logs shared by edge replicas), chromium (a browser's EventSource),
# nodejs and npm (the OpenAI JS SDK, tests/e2e/clients/).
# As root: installs what is missing (one `apt-get update`). Otherwise: names
# what is missing; the tests that need it are skipped with that reason.
set -euo pipefail
need=()
command -v nginx >/dev/null 2>&1 || [ -x /usr/sbin/nginx ] || need+=(nginx-light)
command -v redis-server >/dev/null 2>&1 || need+=(redis-server)
command -v chromium >/dev/null 2>&1 || need+=(chromium)
command -v node >/dev/null 2>&1 || need+=(nodejs)
command -v npm >/dev/null 2>&1 || need+=(npm)
[ ${#need[@]} -eq 0 ] && exit 0
if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "installing Debian packages: ${need[*]}"
    apt-get update -q >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${need[@]}" >/dev/null
else
    echo "missing Debian packages (tests that need them are skipped): ${need[*]}"
    echo "  install with: sudo apt-get install ${need[*]}"
fi
