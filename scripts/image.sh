#!/usr/bin/env bash
# make image [EXTRAS=gpu] [IMAGE=name:tag]: builds pdserve:<version>-<extras> from the
# Dockerfile with docker, podman or buildah (scripts/container.sh), the base image first
# where it is missing (scripts/image_base.sh). pip's settings on this machine go along:
# its index, its CA bundle (as the build secret pip-cert), and, for podman and buildah, a
# local wheel folder that holds the lock's torch (mounted read-only into the build).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/container.sh
pick_container_tool
extras=${EXTRAS:-cpu}
version=$(sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)
image=${IMAGE:-pdserve:$version-$extras}
scripts/image_base.sh

pipconf() { local v; v=$(pip config get "global.$1" 2>/dev/null) && echo "$v"; }
args=(--build-arg "EXTRAS=$extras" -t "$image" -f Dockerfile)
index=${PIP_INDEX_URL:-$(pipconf index-url || true)}
[ -n "$index" ] && args+=(--build-arg "PIP_INDEX_URL=$index")
[ -n "${PDSERVE_TORCH_INDEX:-}" ] && args+=(--build-arg "PDSERVE_TORCH_INDEX=$PDSERVE_TORCH_INDEX")
cert=${PIP_CERT:-$(pipconf cert || true)}
[ -n "$cert" ] && [ -f "$cert" ] && args+=(--secret "id=pip-cert,src=$cert")
torch=$(sed -n 's/^torch==\([^ ;]*\).*/\1/p' "lock/$extras.txt")
if [ "$tool" != docker ]; then
    for dir in ${PIP_FIND_LINKS:-} $(pipconf find-links || true); do
        if compgen -G "$dir/torch-${torch}-*.whl" >/dev/null; then
            args+=(-v "$dir:/wheels:ro" --build-arg PIP_FIND_LINKS=/wheels)
            break
        fi
    done
fi
case $tool in
    docker) DOCKER_BUILDKIT=1 docker build "${args[@]}" . ;;
    podman) podman "${global[@]}" build "${limits[@]}" --network host "${args[@]}" . ;;
    buildah) buildah bud "${limits[@]}" --network host "${args[@]}" . ;;
esac
echo "built $image with $tool"
