"""Partitions of SFT data over federated clients: IID, or non-IID by Dirichlet.

Scenario 3 gives each client its own domain (non-IID); scenario 4 pools the
domains and deals the items at random, so every client holds data of one and
the same distribution (``partition_iid``). Between the two, and over more
clients than domains, ``partition_dirichlet`` draws each domain's shares of
the clients from a symmetric Dirichlet(``alpha``) -- the usual label-skew
benchmark of federated learning (Hsu et al., 2019), the domain standing in
for the label: ``alpha`` 0.1 gives most clients one domain, 1.0 a mix with
uneven sizes, large ``alpha`` the IID deal. Each part is an ordinary SFT
folder whose manifest records the partition and its items per domain.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np
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

SPLITS = ("train", "valid")
#: draws of the Dirichlet shares before a partition that leaves a client
#: without training items is refused
MAX_DRAWS = 100


def partition_iid(
    data_dirs: Sequence[str | Path], out: str | Path, parts: int, *, seed: int = 0
) -> list[Path]:
    """Pool ``data_dirs`` and deal their items at random into ``parts`` folders."""
    splits = _open(data_dirs, parts)
    g = torch.Generator().manual_seed(seed)
    rows = {}
    for split, sources in splits.items():
        n = sum(len(s) for s in sources)
        order = torch.randperm(n, generator=g)
        rows[split] = [idx.sort().values for idx in order.tensor_split(parts)]
    return _write(data_dirs, out, splits, rows, {"kind": "iid", "seed": seed})


def partition_dirichlet(
    data_dirs: Sequence[str | Path],
    out: str | Path,
    parts: int,
    alpha: float,
    *,
    seed: int = 0,
) -> list[Path]:
    """Give each client of ``parts`` its share of every domain (a folder of
    ``data_dirs``), the shares of a domain drawn from Dirichlet(``alpha``);
    the valid split follows the train split's shares. Refused in one line,
    before anything is written, for an ``alpha`` that is not a positive
    number, or when ``MAX_DRAWS`` draws all leave a client without items."""
    if isinstance(alpha, bool) or not isinstance(alpha, int | float):
        raise ValueError(f"--alpha must be a number, got {alpha!r}")
    if not (math.isfinite(alpha) and alpha > 0):
        raise ValueError(f"--alpha must be a finite number > 0, got {alpha}")
    splits = _open(data_dirs, parts)
    rng = np.random.default_rng(seed)
    sizes = [len(s) for s in splits["train"]]
    for _ in range(MAX_DRAWS):
        shares = rng.dirichlet(np.full(parts, float(alpha)), size=len(sizes))
        counts = [_counts(n, share) for n, share in zip(sizes, shares, strict=True)]
        if min(sum(c[i] for c in counts) for i in range(parts)) > 0:
            break
    else:
        raise ValueError(
            f"--alpha {alpha:g} over --parts {parts} left a client without "
            f"training items in each of {MAX_DRAWS} draws of seed {seed}: "
            "raise --alpha or lower --parts"
        )
    rows = {}
    for split, sources in splits.items():
        client_rows: list[list[torch.Tensor]] = [[] for _ in range(parts)]
        offset = 0
        for source, share in zip(sources, shares, strict=True):
            order = torch.from_numpy(rng.permutation(len(source))) + offset
            cuts = np.cumsum(_counts(len(source), share))[:-1].tolist()
            for i, idx in enumerate(order.tensor_split(cuts)):
                client_rows[i].append(idx)
            offset += len(source)
        rows[split] = [torch.cat(r).sort().values for r in client_rows]
    record = {"kind": "dirichlet", "alpha": float(alpha), "seed": seed}
    return _write(data_dirs, out, splits, rows, record)


def _counts(n: int, share: np.ndarray) -> list[int]:
    """``n`` items in proportion to ``share`` (largest remainders: they add
    up to ``n`` exactly)."""
    exact = share * n
    counts = np.floor(exact).astype(int)
    left = n - int(counts.sum())
    counts[np.argsort(counts - exact)[:left]] += 1
    return counts.tolist()


def _open(data_dirs: Sequence[str | Path], parts: int) -> dict[str, list[SFTData]]:
    """The train and valid splits of ``data_dirs``, checked against ``parts``
    before anything is written."""
    if isinstance(parts, bool) or not isinstance(parts, int) or parts < 2:
        raise ValueError(f"--parts must be an integer >= 2, got {parts!r}")
    splits = {s: open_sft_many(data_dirs, s) for s in SPLITS}
    items = sum(len(s) for s in splits["train"])
    if parts > items:
        raise ValueError(
            f"--parts {parts} is more than the {items} training items to deal: "
            "every client needs some"
        )
    return splits


def _write(
    data_dirs: Sequence[str | Path],
    out: str | Path,
    splits: dict[str, list[SFTData]],
    rows: dict[str, list[torch.Tensor]],
    record: dict,
) -> list[Path]:
    """Part ``i`` holds rows ``rows[split][i]`` of the pooled ``split``, and
    every test item (the domains' own test sets, scored per domain)."""
    parts = len(rows["train"])
    first = splits["train"][0]
    corpora = [s.manifest["corpus"] for s in splits["train"]]
    bounds = np.cumsum([0] + [len(s) for s in splits["train"]])
    test_lines = "".join(
        (Path(d) / TEST_ITEMS).read_text(encoding="utf-8") for d in data_dirs
    )
    out, tmp = start_folder(out, overwrite=None)
    manifests = []
    for i in range(parts):
        train = rows["train"][i].numpy()
        per_domain = np.histogram(train, bins=bounds)[0].tolist()
        manifests.append(
            {
                **first.manifest,
                "corpus": f"{record['kind']} part {i + 1}/{parts} of "
                + "+".join(corpora),
                "partition": {
                    **record,
                    "of": [str(Path(d).resolve()) for d in data_dirs],
                    "part": i,
                    "parts": parts,
                    "train_items_per_domain": dict(
                        zip(corpora, per_domain, strict=True)
                    ),
                },
                "splits": {},
            }
        )
    for split, sources in splits.items():
        pooled = {
            k: torch.cat([getattr(s, k) for s in sources])
            for k in ("tokens", "answer_start", "length")
        }
        for i, idx in enumerate(rows[split]):
            d = tmp / f"part{i}"
            d.mkdir(parents=True, exist_ok=True)
            tensors = {k: v[idx].contiguous() for k, v in pooled.items()}
            path = d / f"{split}.safetensors"
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
    for i in range(parts):
        d = tmp / f"part{i}"
        (d / TEST_ITEMS).write_text(test_lines, encoding="utf-8")
        manifests[i]["splits"]["test"] = {"items": n_test, "file": TEST_ITEMS}
        seal_folder(d, manifests[i], first.data_dir / TOKENIZER_FILE)
    publish_dir(tmp, out)
    return [out / f"part{i}" for i in range(parts)]
