#!/usr/bin/env bash
# Regenerate the Python modules for MindSpore's checkpoint format and its
# parallel strategy file.
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
  "$repo/src/aisyn/model/mindspore_checkpoint.proto" \
  "$repo/src/aisyn/model/mindspore_strategy.proto"

gen="$tmp/aisyn/model"
# ruff's generated-code exclude in pyproject covers *_pb2*.py, not .pyi.
mkdir -p "$out"
for name in mindspore_checkpoint mindspore_strategy; do
  sed -i '1i # ruff: noqa\n# fmt: off' "$gen/${name}_pb2.pyi"
  cp "$gen/${name}_pb2.py" "$gen/${name}_pb2.pyi" "$out/"
done
echo "generated into $out"
