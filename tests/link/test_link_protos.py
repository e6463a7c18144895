"""The committed generated modules are exactly what gen_protos.sh produces."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
GENERATED = REPO / "src/aisyn/link/proto"
FILES = ["tensor_link_pb2.py", "tensor_link_pb2.pyi", "tensor_link_pb2_grpc.py"]


def test_regenerating_protos_is_a_no_op(tmp_path):
    env = {**os.environ, "PYTHON": sys.executable}
    subprocess.run(
        ["bash", str(REPO / "scripts/gen_protos.sh"), str(tmp_path)],
        check=True,
        env=env,
        capture_output=True,
        timeout=60,
    )
    for name in FILES:
        assert (tmp_path / name).read_bytes() == (GENERATED / name).read_bytes(), (
            f"{name} is stale: run scripts/gen_protos.sh"
        )


def test_generated_grpc_module_imports_relatively():
    text = (GENERATED / "tensor_link_pb2_grpc.py").read_text()
    assert "from . import tensor_link_pb2" in text
    from aisyn.link.proto import tensor_link_pb2_grpc

    assert hasattr(tensor_link_pb2_grpc, "TensorLinkStub")
