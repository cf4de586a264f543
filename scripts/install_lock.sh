#!/usr/bin/env bash
# Makes a Python environment hold exactly what a lock file names (lock/*.txt, scripts/lock.sh):
# each pinned version installed without resolving again (--no-deps), anything else removed.
# torch first, on its own: a CPU build (+cpu) that the default index lacks comes from PyTorch's
# CPU index ($PDSERVE_TORCH_INDEX), and only torch is looked up there.
# PDSERVE_INSTALLER=uv (default) installs in parallel: the dev lock in ~10 s where pip takes
# ~170 s on 2 cores; pip is the fallback, and what the image build uses.
# Usage: scripts/install_lock.sh PYTHON LOCK
set -euo pipefail
py=$1 lock=$2
torch_index=${PDSERVE_TORCH_INDEX:-https://download.pytorch.org/whl/cpu}
pip=("$py" -m pip --disable-pip-version-check)
if [ "${PDSERVE_INSTALLER:-uv}" = uv ] && "${pip[@]}" install -q "uv==0.13.8" 2>/dev/null; then
    links=()  # pip's local wheel folders, which uv does not read from pip's settings
    for l in ${PIP_FIND_LINKS:-}; do links+=(--find-links "$l"); done
    # No bytecode here (pip writes it all): `make test` writes what runs, as it first runs.
    install=("$(dirname "$py")/uv" pip install -q --python "$py" --no-deps "${links[@]}")
    uninstall=("$(dirname "$py")/uv" pip uninstall -q --python "$py")
else
    install=("${pip[@]}" install -q --no-deps)
    uninstall=("${pip[@]}" uninstall -q -y)
fi
torch=$(sed -n 's/^\(torch==[^ ;]*\).*/\1/p' "$lock")
if [ -n "$torch" ] && ! "${install[@]}" "$torch" 2>/dev/null; then
    case "$torch" in
        *+cpu) "${install[@]}" --index-url "$torch_index" "$torch" ;;
        *) "${install[@]}" "$torch" ;;  # shows the installer's own error
    esac
fi
"${install[@]}" -r "$lock"
# What an earlier install left that the lock does not name (pdserve itself is installed after).
norm() { sed -e 's/[ ;@=].*//' -e 's/[-_.]\+/-/g' | tr A-Z a-z | sort -u; }
extra=$(comm -23 <("${pip[@]}" list --format=freeze | norm) \
                 <({ grep -v '^ *#' "$lock"; printf 'pip\npdserve\nuv\n'; } | norm))
[ -z "$extra" ] || "${uninstall[@]}" $extra
