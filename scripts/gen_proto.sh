#!/usr/bin/env bash
# Regenerates the gRPC stubs in pdserve/v1/ from proto/pdserve/v1/*.proto.
# Stubs are committed; `make check-proto` fails when they are stale.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
out=${1:-.}
mkdir -p "$out/pdserve/v1"
"$PY" -m grpc_tools.protoc -Iproto \
  --python_out="$out" --pyi_out="$out" --grpc_python_out="$out" \
  proto/pdserve/v1/*.proto
touch "$out/pdserve/v1/__init__.py"
