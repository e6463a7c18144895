"""One fingerprint of model weights for every regime that compares bases."""

from __future__ import annotations

import torch
from safetensors.torch import save_file

from aisyn.train import checkpoint as ckpt


def test_same_weights_in_two_files_have_one_fingerprint(tmp_path, monkeypatch):
    monkeypatch.setenv("AISYN_CACHE", str(tmp_path / "cache"))
    tensors = {"b": torch.arange(6.0).view(2, 3), "a": torch.ones(4)}
    save_file(tensors, str(tmp_path / "x.safetensors"), metadata={"saved": "1"})
    save_file(dict(reversed(tensors.items())), str(tmp_path / "y.safetensors"))
    x, y = (tmp_path / n for n in ("x.safetensors", "y.safetensors"))
    assert x.read_bytes() != y.read_bytes()
    assert ckpt.file_fingerprint(x) == ckpt.file_fingerprint(y)
    assert ckpt.file_fingerprint(x) == ckpt.tensors_fingerprint(tensors)
    changed = {**tensors, "a": torch.tensor([1.0, 1.0, 1.0, 1.0 + 1e-6])}
    assert ckpt.tensors_fingerprint(changed) != ckpt.tensors_fingerprint(tensors)
    # a subset (what split parties compare) is a fingerprint of its own
    assert ckpt.tensors_fingerprint({"a": tensors["a"]}) != ckpt.file_fingerprint(x)
