#!/usr/bin/env bash
# Makes a Python environment hold exactly what a lock file names (lock/*.txt, scripts/lock.sh):
# each pinned version installed without resolving again (--no-deps), anything else removed.
# torch first, on its own: a CPU build (+cpu) that pip's indexes lack comes from PyTorch's
# CPU index ($PDSERVE_TORCH_INDEX), and only torch is looked up there.
# Usage: scripts/install_lock.sh PYTHON LOCK
set -euo pipefail
py=$1 lock=$2
torch_index=${PDSERVE_TORCH_INDEX:-https://download.pytorch.org/whl/cpu}
pip=("$py" -m pip --disable-pip-version-check)
torch=$(sed -n 's/^\(torch==[^ ;]*\).*/\1/p' "$lock")
if [ -n "$torch" ] && ! "${pip[@]}" install -q --no-deps "$torch" 2>/dev/null; then
    case "$torch" in
        *+cpu) "${pip[@]}" install -q --no-deps --index-url "$torch_index" "$torch" ;;
        *) "${pip[@]}" install -q --no-deps "$torch" ;;  # shows pip's own error
    esac
fi
"${pip[@]}" install -q --no-deps -r "$lock"
# What an earlier install left that the lock does not name (pdserve itself is installed after).
norm() { sed -e 's/[ ;@=].*//' -e 's/[-_.]\+/-/g' | tr A-Z a-z | sort -u; }
extra=$(comm -23 <("${pip[@]}" list --format=freeze | norm) \
                 <({ grep -v '^ *#' "$lock"; printf 'pip\npdserve\n'; } | norm))
[ -z "$extra" ] || "${pip[@]}" uninstall -q -y $extra
