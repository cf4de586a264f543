#!/usr/bin/env bash
# Sourced by the image scripts: picks the container tool and the options this machine needs.
#   $tool     docker (with a running engine), else podman, else buildah
#   $global   podman's own options; where cgroups are v1 or hybrid (crun refuses them) and
#             runc is installed: runc with cgroupfs
#   $limits   where the sandbox cannot raise rlimits (no CAP_SYS_RESOURCE), lower ones,
#             as a container cannot copy the host's
pick_container_tool() {
    tool=${CONTAINER_TOOL:-}
    if [ -z "$tool" ]; then
        if command -v docker >/dev/null && docker info >/dev/null 2>&1; then tool=docker
        elif command -v podman >/dev/null; then tool=podman
        elif command -v buildah >/dev/null; then tool=buildah
        else echo "no docker engine, podman or buildah: install one (Debian: apt-get install podman runc)" >&2
             return 1
        fi
    fi
    global=() limits=()
    if [ "$tool" != docker ]; then
        if [ "$(stat -fc %T /sys/fs/cgroup)" != cgroup2fs ] && command -v runc >/dev/null; then
            global=(--runtime runc --cgroup-manager=cgroupfs)
            [ "$tool" = buildah ] && global=()
        fi
        local eff; eff=$(sed -n 's/^CapEff:\s*//p' /proc/self/status)
        if [ "$(id -u)" = 0 ] && (( ((16#$eff) >> 24 & 1) == 0 )); then   # CAP_SYS_RESOURCE
            limits=(--ulimit nofile=10000:10000 --ulimit nproc=4096:4096)
        fi
    fi
}
