#!/usr/bin/env bash
# Regenerate the Python modules for the link's wire format.
#
#   scripts/gen_protos.sh [OUT_DIR]     (default: src/aisyn/link/proto)
#
# The proto is compiled with -I src so it registers as
# "aisyn/link/tensor_link.proto" in protobuf's global descriptor pool (a bare
# "tensor_link.proto" could collide with another package's file). grpc_tools
# then emits an absolute "from aisyn.link import tensor_link_pb2" which we
# rewrite to a relative import so the generated package stays relocatable.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
out="${1:-$repo/src/aisyn/link/proto}"
python="${PYTHON:-python}"

tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT

"$python" -m grpc_tools.protoc \
  -I "$repo/src" \
  --python_out="$tmp" \
  --pyi_out="$tmp" \
  --grpc_python_out="$tmp" \
  "$repo/src/aisyn/link/tensor_link.proto"

gen="$tmp/aisyn/link"
sed -i 's/^from aisyn\.link import tensor_link_pb2 as /from . import tensor_link_pb2 as /' \
  "$gen/tensor_link_pb2_grpc.py"
if grep -q '^from aisyn' "$gen/tensor_link_pb2_grpc.py"; then
  echo "gen_protos.sh: absolute import left in tensor_link_pb2_grpc.py" >&2
  exit 1
fi

# The stub is for type checkers only; ruff's generated-code exclude in
# pyproject matches *_pb2*.py, not .pyi, so opt the stub out of linting and
# formatting explicitly (otherwise a tree-wide `ruff format` makes it stale).
sed -i '1i # ruff: noqa\n# fmt: off' "$gen/tensor_link_pb2.pyi"

mkdir -p "$out"
cp "$gen/tensor_link_pb2.py" "$gen/tensor_link_pb2.pyi" "$gen/tensor_link_pb2_grpc.py" "$out/"
echo "generated into $out"
