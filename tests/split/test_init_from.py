"""``--init-from`` (the reference's scenario 2): B pre-trains a base with
``aisyn train``; both parties start the split run from it, each loading only its
own tensors, and the handshake refuses parties that start from different bases."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import CUT, losses, start_server, train_cfg
from safetensors.torch import load_file, save_file

from aisyn.link.errors import HandshakeError
from aisyn.model.segments import DATA_PARTY, own_tensor_shapes, parse_partition
from aisyn.split.backbone.compute_party import ComputeParty
from aisyn.split.client.train import split_train
from aisyn.split.party import open_base
from aisyn.split.session import SplitOptions
from aisyn.split.transport import LinkSettings
from aisyn.train import checkpoint as ckpt
from aisyn.train.pretrain import train

REL = 1e-5


@pytest.fixture(scope="module")
def base(tmp_path_factory, news_data, split_config) -> Path:
    """B's pre-training: a 4-step ``aisyn train`` run with checkpoints at 2 and 4."""
    out = tmp_path_factory.mktemp("base") / "run"
    cfg = train_cfg(steps=4, ckpt_every=2, seed=5)
    train(split_config, [news_data], out, cfg, progress=False)
    return out


def _write_subset(src: Path, dst: Path, keep) -> Path:
    tensors = load_file(str(ckpt.model_file(src)))
    save_file({k: v for k, v in tensors.items() if keep(k)}, str(dst))
    return dst


@pytest.mark.heavy
def test_split_from_base_matches_train_from_base(
    tmp_path, news_data, split_config, base
):
    # Prepare: the unsplit run from the same base, data and seed
    cfg = train_cfg(steps=5)
    train(split_config, [news_data], tmp_path / "ref", cfg, init_from=base)
    # Execute
    split_train(
        split_config,
        [news_data],
        tmp_path / "split",
        cfg,
        SplitOptions(cut=CUT, mode="local"),
        init_from=base,
        progress=False,
    )
    # Assert: every step's loss, and the base was really used
    want, got = losses(tmp_path / "ref"), losses(tmp_path / "split")
    assert len(got) == len(want) == 5
    worst = max(abs(g - w) / abs(w) for g, w in zip(got, want, strict=True))
    assert worst <= REL, f"max relative loss difference {worst:.3g} > {REL}"
    assert abs(got[0] - losses(base)[0]) > 1e-3  # not the seeded random init


def test_different_bases_are_refused(
    tmp_path, news_data, split_config, base, token_file
):
    """Checkpoints 2 and 4 of one run share a safetensors header; the
    fingerprint covers the bytes, so the handshake still tells them apart."""
    # Prepare: a compute party serving from step 4 of the base run
    settings = LinkSettings("127.0.0.1:0", token_file=str(token_file), insecure=True)
    step4 = base / "checkpoints" / "step_00000004"
    step2 = base / "checkpoints" / "step_00000002"
    refusals = [
        (step2, r"starts from base \w{12}, this compute party from base \w{12}; "),
        (None, r"starts from random init, this compute party from base \w{12}; "),
    ]
    with start_server(split_config, tmp_path / "b", settings, init_from=step4) as s:
        peer = LinkSettings(s.address, token_file=str(token_file), insecure=True)

        def run(name: str, init_from: Path | None) -> None:
            split_train(
                split_config,
                [news_data],
                tmp_path / name,
                train_cfg(steps=1),
                SplitOptions(cut=CUT, mode="grpc", peer=peer),
                init_from=init_from,
                progress=False,
            )

        # Execute / Assert
        for i, (a_init, match) in enumerate(refusals):
            with pytest.raises(HandshakeError, match=match + "a fresh run needs"):
                run(f"refused{i}", a_init)
        run("same", base)  # the run folder: its latest checkpoint, step 4
    assert len(losses(tmp_path / "same")) == 1


def test_base_without_the_partys_tensors_is_refused(
    tmp_path, news_data, split_config, base
):
    # Prepare: files holding only B's middle, only A's part, a misshapen A part
    partition = parse_partition(CUT, split_config)
    a_names = own_tensor_shapes(split_config, partition, DATA_PARTY)
    only_b = _write_subset(base, tmp_path / "b.safetensors", lambda k: k not in a_names)
    only_a = _write_subset(base, tmp_path / "a.safetensors", lambda k: k in a_names)
    no_wpe = _write_subset(base, tmp_path / "c.safetensors", lambda k: "wpe" not in k)
    bad = load_file(str(only_a))
    bad["transformer.wpe.weight"] = bad["transformer.wpe.weight"][:-1]
    save_file(bad, str(tmp_path / "bad.safetensors"))
    # Execute / Assert: A refuses before anything starts, in one line
    with pytest.raises(
        ckpt.CheckpointError,
        match=r"b\.safetensors: lacks \d+ of the 53 tensors party A needs "
        r"\(cut u:1,1\) \(transformer\.h\.0\.",
    ):
        split_train(
            split_config,
            [news_data],
            tmp_path / "run",
            train_cfg(steps=1),
            SplitOptions(cut=CUT, mode="local"),
            init_from=only_b,
            progress=False,
        )
    assert not (tmp_path / "run").exists()
    with pytest.raises(ckpt.CheckpointError, match=r"wpe\.weight has shape"):
        open_base(tmp_path / "bad.safetensors", split_config, partition, DATA_PARTY)
    # A's part alone is enough for A; B needs the whole base to check A's against
    open_base(only_a, split_config, partition, DATA_PARTY)
    with pytest.raises(ckpt.CheckpointError, match="party B needs"):
        ComputeParty(split_config, partition, None, init_from=only_a)
    with pytest.raises(ckpt.CheckpointError, match="give it the whole base model"):
        ComputeParty(split_config, partition, None, init_from=no_wpe)
