#!/usr/bin/env bash
# Regenerate the Python module for MindSpore's checkpoint format.
#
#   scripts/gen_mindspore_proto.sh [OUT_DIR]     (default: src/aisyn/model/proto)
#
# Compiled with -I src so the file registers as
# "aisyn/model/mindspore_checkpoint.proto" in protobuf's global descriptor pool
# (MindSpore's own registers as "checkpoint.proto"; the two never collide).
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
out="${1:-$repo/src/aisyn/model/proto}"
python="${PYTHON:-python}"

tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT

"$python" -m grpc_tools.protoc \
  -I "$repo/src" \
  --python_out="$tmp" \
  --pyi_out="$tmp" \
  "$repo/src/aisyn/model/mindspore_checkpoint.proto"

gen="$tmp/aisyn/model"
# ruff's generated-code exclude in pyproject covers *_pb2*.py, not .pyi.
sed -i '1i # ruff: noqa\n# fmt: off' "$gen/mindspore_checkpoint_pb2.pyi"

mkdir -p "$out"
cp "$gen/mindspore_checkpoint_pb2.py" "$gen/mindspore_checkpoint_pb2.pyi" "$out/"
echo "generated into $out"
