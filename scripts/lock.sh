#!/usr/bin/env bash
# Writes lock/*.txt, the one lock `make` and the Dockerfile install from (--no-deps, exactly):
#   lock/cpu.txt, lock/gpu.txt          what the image for each device holds
#   lock/cpu-dev.txt, lock/gpu-dev.txt  what `make test` installs (the extra and dev)
# Resolved for CPython 3.11 on x86_64 Linux (manylinux_2_28: Debian 12, the image's base).
# torch's CPU build is on PyTorch's CPU index ($PDSERVE_TORCH_INDEX), or in a local wheel
# folder pip is pointed at (PIP_FIND_LINKS or pip's config), which is looked at first; the
# GPU locks see neither (their torch is the CUDA build from the package index).
# Usage: scripts/lock.sh [UV]   (default: .venv/bin/uv; `make lock`)
set -euo pipefail
cd "$(dirname "$0")/.."
uv=${1:-.venv/bin/uv}
torch_index=${PDSERVE_TORCH_INDEX:-https://download.pytorch.org/whl/cpu}
links=() torch_src=(--extra-index-url "$torch_index")
for dir in ${PIP_FIND_LINKS:-} $(pip config get global.find-links 2>/dev/null || true); do
    [ -d "$dir" ] || continue
    links+=(--find-links "$dir")
    compgen -G "$dir/torch-*+cpu-*.whl" >/dev/null && torch_src=()
done
common=(--quiet --no-header --python-version 3.11 --python-platform x86_64-manylinux_2_28)
# The CPU torch makes these fail to import and they are unused there (triton: 1 GB).
cpu=(--index-strategy unsafe-best-match "${links[@]}" "${torch_src[@]}" --no-emit-package torchvision --no-emit-package torchaudio
     --no-emit-package torchcodec --no-emit-package triton)
"$uv" pip compile pyproject.toml "${common[@]}" "${cpu[@]}" --extra cpu -o lock/cpu.txt
"$uv" pip compile pyproject.toml "${common[@]}" "${cpu[@]}" --extra cpu --extra dev -o lock/cpu-dev.txt
"$uv" pip compile pyproject.toml "${common[@]}" --extra gpu -o lock/gpu.txt
"$uv" pip compile pyproject.toml "${common[@]}" --extra gpu --extra dev -o lock/gpu-dev.txt
