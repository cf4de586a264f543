#!/usr/bin/env bash
# Makes sure the Dockerfile's base image (python:<version>-slim-<debian>) is present: as it
# is, pulled, or, where no registry answers and the tool is podman or buildah, built from
# Debian's packages: debootstrap of the same Debian release with its python3 (the same
# minor version; venv, and the headers that setup.py's C parts compile against), imported
# under the exact name the Dockerfile's FROM uses. The Dockerfile itself is unchanged.
# Usage: scripts/image_base.sh   (tool from scripts/container.sh)
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/container.sh
pick_container_tool
python=$(sed -n 's/^ARG PYTHON_VERSION=//p' Dockerfile)
from=$(grep -m1 '^FROM ' Dockerfile | awk '{print $2}')
base=docker.io/library/${from//\$\{PYTHON_VERSION\}/$python}       # python:3.11-slim-bookworm
release=${base##*-}

present() { case $tool in docker) docker image inspect "$1" ;; *) $tool "${global[@]}" image exists "$1" ;; esac >/dev/null 2>&1; }
present "$base" && exit 0
echo "base image $base: pulling" >&2
timeout 120 $tool "${global[@]}" pull -q "$base" >/dev/null 2>&1 && exit 0
if [ "$tool" = docker ] || [ "$(id -u)" != 0 ] || ! command -v debootstrap >/dev/null; then
    echo "cannot pull $base, and building it needs root, podman or buildah, and debootstrap" >&2
    exit 1
fi
echo "base image $base: no registry answers; building it from Debian $release's packages" >&2
mirror=$(sed -n 's/^URIs: *\([^ ]*\/debian\)$/\1/p; s/^deb \([^ ]*\/debian\) '"$release"' .*/\1/p' \
             /etc/apt/sources.list.d/*.sources /etc/apt/sources.list 2>/dev/null | head -1)
root=$(mktemp -d /var/tmp/pdserve-base.XXXXXX)
trap 'rm -rf "$root"' EXIT
debootstrap --variant=minbase \
    --include=python3,python3-venv,python-is-python3,libpython3-dev,ca-certificates,netbase,tzdata \
    "$release" "$root" $mirror >"$root.log" 2>&1 || { tail -20 "$root.log" >&2; exit 1; }
rm -f "$root.log"
got=$(chroot "$root" python3 -c 'import sys; print("%d.%d" % sys.version_info[:2])')
[ "$got" = "$python" ] || { echo "Debian $release has Python $got, the Dockerfile asks for $python" >&2; exit 1; }
rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/*.bin
case $tool in
    podman) tar -C "$root" -c . | podman "${global[@]}" import --change 'ENV LANG=C.UTF-8' \
                --change 'CMD ["python3"]' - "$base" >/dev/null ;;
    buildah) c=$(buildah from scratch) && buildah copy "$c" "$root" / >/dev/null \
                && buildah config --env LANG=C.UTF-8 --cmd python3 "$c" \
                && buildah commit -q "$c" "$base" >/dev/null && buildah rm "$c" >/dev/null ;;
esac
echo "base image $base: built" >&2
