"""IID partitions of pooled SFT data: the reference's scenario 4 (same distribution).

Scenario 3 gives each client its own domain (non-IID); scenario 4 pools the
domains and deals the items at random, so every client holds data of one and
the same distribution. Each part is an ordinary SFT folder.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors.torch import save_file

from aisyn.data.folder import (
    TOKENIZER_FILE,
    file_sha256,
    publish_dir,
    seal_folder,
    start_folder,
)
from aisyn.data.sft import TEST_ITEMS, SFTData, open_sft_many


def partition_iid(
    data_dirs: Sequence[str | Path], out: str | Path, parts: int, *, seed: int = 0
) -> list[Path]:
    if parts < 2:
        raise ValueError(f"--parts must be >= 2, got {parts}")
    splits: dict[str, list[SFTData]] = {
        s: open_sft_many(data_dirs, s) for s in ("train", "valid")
    }
    first = splits["train"][0]
    test_lines = "".join(
        (Path(d) / TEST_ITEMS).read_text(encoding="utf-8") for d in data_dirs
    )
    out, tmp = start_folder(out, overwrite=None)
    dirs = [tmp / f"part{i}" for i in range(parts)]
    for d in dirs:
        d.mkdir(parents=True)
    g = torch.Generator().manual_seed(seed)
    manifests = [
        {
            **first.manifest,
            "corpus": f"iid part {i + 1}/{parts} of "
            + "+".join(s.manifest["corpus"] for s in splits["train"]),
            "partition": {
                "of": [str(Path(d).resolve()) for d in data_dirs],
                "part": i,
                "parts": parts,
                "seed": seed,
            },
            "splits": {},
        }
        for i in range(parts)
    ]
    for split, sources in splits.items():
        pooled = {
            k: torch.cat([getattr(s, k) for s in sources])
            for k in ("tokens", "answer_start", "length")
        }
        order = torch.randperm(len(pooled["tokens"]), generator=g)
        for i, idx in enumerate(order.tensor_split(parts)):
            idx = idx.sort().values  # keep a stable in-file order
            tensors = {k: v[idx].contiguous() for k, v in pooled.items()}
            path = dirs[i] / f"{split}.safetensors"
            save_file(tensors, str(path))
            manifests[i]["splits"][split] = {
                "items": len(idx),
                "answer_tokens": int(
                    (tensors["length"] - tensors["answer_start"]).sum()
                ),
                "file": path.name,
                "sha256": file_sha256(path),
            }
    n_test = sum(1 for line in test_lines.splitlines() if line.strip())
    for i, d in enumerate(dirs):
        (d / TEST_ITEMS).write_text(test_lines, encoding="utf-8")
        manifests[i]["splits"]["test"] = {"items": n_test, "file": TEST_ITEMS}
        seal_folder(d, manifests[i], first.data_dir / TOKENIZER_FILE)
    publish_dir(tmp, out)
    return [out / f"part{i}" for i in range(parts)]
