"""Model-parallel rank files, merged into one model by ``aisyn convert``.

The rank files are written here the way MindSpore's model parallelism cuts
the official PanGu-α (mindformers' shard strategies, as each cell declares
them): every rank holds ``np.split``'s piece of each cut tensor, the whole of
every other, and a strategy file (``ParallelStrategyMap``) says which.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from aisyn.cli import main
from aisyn.model.mindspore_ckpt import read_checkpoint, write_checkpoint
from aisyn.model.mindspore_pangu import gather_weights, infer_config, to_state_dict
from aisyn.model.mindspore_parallel import SliceLayout, rank_order, read_strategy
from aisyn.model.proto.mindspore_strategy_pb2 import ParallelStrategyMap
from aisyn.train.models import load_run_model

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures/mindspore"

#: each cell's weight shard strategy, as mindformers declares it (``mp`` the
#: model-parallel degree): MultiHeadAttention dense1/2/3 ((dp, 1), (mp, 1)) on
#: [out, in] with bias (mp,); its projection ((dp, mp), (mp, 1)) on [in, out],
#: bias (1,); FeedForward mapping ((dp, 1), (1, mp)), bias (mp,); projection
#: ((dp, mp), (mp, 1)), bias (1,); the vocabulary-parallel embedding (mp, 1).
SHARDS = {
    "attention.dense1.weight": ("mp", 1),
    "attention.dense1.bias": ("mp",),
    "attention.dense2.weight": ("mp", 1),
    "attention.dense2.bias": ("mp",),
    "attention.dense3.weight": ("mp", 1),
    "attention.dense3.bias": ("mp",),
    "attention.projection.weight": ("mp", 1),
    "output.mapping.weight": (1, "mp"),
    "output.mapping.bias": ("mp",),
    "output.projection.weight": ("mp", 1),
}
WORD = "backbone.embedding.word_embedding.embedding_table"


def shard_of(name: str, vocab_parallel: bool) -> tuple | None:
    if name == WORD:
        return ("mp", 1) if vocab_parallel else None
    for leaf, shard in SHARDS.items():
        if name.endswith(leaf):
            return shard
    return None  # replicated: LayerNorms, biases after a cut input, embeddings


def plain() -> dict[str, torch.Tensor]:
    return read_checkpoint(FIXTURES / "plain.ckpt")


def cut(t: torch.Tensor, shard: tuple | None, mp: int, piece: int) -> torch.Tensor:
    """Rank ``piece``'s slice: np.split along the axis the shard cuts by mp."""
    if shard is None:
        return t.clone()
    axis = shard.index("mp")
    return torch.from_numpy(np.split(t.numpy(), mp, axis=axis)[piece].copy())


def write_ranks(tmp_path, mp: int, dp: int = 1, vocab_parallel: bool = False):
    """dp * mp rank files, rank r = d * mp + m holding model-parallel piece m
    (MindSpore's device matrix [dp, mp, 1] enumerated row-major), each with
    its optimizer moments and loop state as a training run saves them; and
    the strategy file that says so."""
    whole = plain()
    files = []
    for rank in range(dp * mp):
        piece = rank % mp
        tensors = {}
        for name, t in whole.items():
            tensors[name] = cut(t, shard_of(name, vocab_parallel), mp, piece)
            tensors[f"adam_m.{name}"] = torch.zeros_like(tensors[name])
        tensors["cur_step_num"] = torch.tensor(100, dtype=torch.int32)
        path = tmp_path / f"rank_{rank}" / "pangu-100_1.ckpt"
        path.parent.mkdir()
        write_checkpoint(path, tensors)
        files.append(path)
    strategy = ParallelStrategyMap(current_stage=0)
    for name, t in whole.items():
        shard = shard_of(name, vocab_parallel)
        item = strategy.parallel_layout_item.add(param_name=name)
        item.parallel_layouts.dev_matrix.add().dim.extend([dp, mp, 1])
        # tensor_map k names device axis len - 1 - k: mp is axis 1, i.e. k = 1
        tmap = [1 if (shard and shard[i] == "mp") else -1 for i in range(t.dim())]
        item.parallel_layouts.tensor_map.add().dim.extend(tmap)
        item.parallel_layouts.field = 0
    (tmp_path / "strategy.ckpt").write_bytes(strategy.SerializeToString())
    return files, tmp_path / "strategy.ckpt"


def convert(files, out, *extra) -> int:
    argv = ["convert", "--from", "mindspore", *map(str, files), "--out", str(out)]
    return main([*argv, "--num-heads", "2", *extra])


def assert_is_the_whole_model(out):
    weights = gather_weights({"plain": plain()})
    whole = to_state_dict(weights, infer_config(weights, num_heads=2))
    merged = load_run_model(out)[0].state_dict()
    for k, t in whole.items():
        assert torch.equal(merged[k], t), k


@pytest.mark.parametrize("mp, vocab_parallel", [(2, True), (8, False), (8, True)])
def test_rank_files_merge_by_pangus_layout(mp, vocab_parallel, tmp_path, capsys):
    files, _ = write_ranks(tmp_path, mp, vocab_parallel=vocab_parallel)
    first = read_checkpoint(files[0])
    assert first["backbone.blocks.0.attention.dense1.weight"].shape == (8 // mp, 8)
    assert first["backbone.blocks.1.output.mapping.weight"].shape == (8, 32 // mp)
    # given out of order (a shell's glob puts rank_10 before rank_2): the paths
    # name the ranks, and they are merged in rank order
    assert convert(files[::-1], tmp_path / "base") == 0
    assert "2 heads" in capsys.readouterr().out
    assert_is_the_whole_model(tmp_path / "base")


def test_rank_files_merge_by_the_strategy_file_with_data_parallel_copies(tmp_path):
    # 4 ranks: dp 2 x mp 2, ranks 0 and 2 hold piece 0, 1 and 3 piece 1
    files, strategy = write_ranks(tmp_path, mp=2, dp=2, vocab_parallel=True)
    assert convert(files, tmp_path / "base", "--strategy", str(strategy)) == 0
    assert_is_the_whole_model(tmp_path / "base")


def test_dp_copies_without_the_strategy_are_one_line(tmp_path, capsys):
    files, _ = write_ranks(tmp_path, mp=2, dp=2)
    assert convert(files, tmp_path / "base") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "expected (8, 8)" in err[0]
    assert not (tmp_path / "base").exists()


def test_a_missing_rank_file_is_named(tmp_path, capsys):
    files, strategy = write_ranks(tmp_path, mp=8)
    assert convert(files[:7], tmp_path / "a") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "has shape (7, 8), expected (8, 8)" in err[0]
    assert convert(files[:7], tmp_path / "b", "--strategy", str(strategy)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "has 8 ranks, but 7 files hold the tensor" in err[0]


def test_files_of_different_models_are_refused(tmp_path, capsys):
    files, _ = write_ranks(tmp_path, mp=2)
    other = read_checkpoint(files[1])
    other["backbone.layernorm.gamma"] = other["backbone.layernorm.gamma"] + 1
    write_checkpoint(files[1], other)
    assert convert(files, tmp_path / "base") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "backbone.layernorm.gamma (in 2 files)" in err[0]
    assert "different values" in err[0]


def test_two_models_word_embeddings_are_not_taken_for_a_vocabulary_cut(
    tmp_path, capsys
):
    # whole (uncut) files whose only difference is the word embedding: a
    # vocabulary-parallel cut happens only with the attention cut too
    whole = plain()
    other = {**whole, WORD: whole[WORD] + 1}
    write_checkpoint(tmp_path / "a.ckpt", whole)
    write_checkpoint(tmp_path / "b.ckpt", other)
    assert convert([tmp_path / "a.ckpt", tmp_path / "b.ckpt"], tmp_path / "o") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{WORD} (in 2 files)" in err[0]


@pytest.mark.parametrize(
    "name",
    ["backbone.blocks.0.attention.dense1.weight", "backbone.layernorm.gamma"],
)
def test_slices_of_mixed_dtypes_are_refused(name, tmp_path, capsys):
    files, _ = write_ranks(tmp_path, mp=2)
    rank1 = read_checkpoint(files[1])
    rank1[name] = rank1[name].double()  # torch.cat would promote silently
    write_checkpoint(files[1], rank1)
    assert convert(files, tmp_path / "base") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "the files hold it as float32 and float64" in err[0]


def test_one_file_holding_a_weight_under_two_names_is_no_rank_set(tmp_path, capsys):
    whole = plain()
    twice = {**whole, "backbone.word_embedding_table": whole[WORD] + 1}
    write_checkpoint(tmp_path / "rank_0.ckpt", twice)
    write_checkpoint(tmp_path / "rank_1.ckpt", whole)
    files = [tmp_path / "rank_0.ckpt", tmp_path / "rank_1.ckpt"]
    assert convert(files, tmp_path / "o") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "give each tensor once" in err[0]


def test_data_parallel_copies_that_disagree_are_refused(tmp_path, capsys):
    files, strategy = write_ranks(tmp_path, mp=2, dp=2)
    rank2 = read_checkpoint(files[2])
    name = "backbone.blocks.0.attention.dense1.weight"
    rank2[name] = rank2[name] + 1
    write_checkpoint(files[2], rank2)
    assert convert(files, tmp_path / "base", "--strategy", str(strategy)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "disagree (rank 2)" in err[0]


# --- the strategy file ----------------------------------------------------------------


def test_slice_layout_follows_mindsporess_rank_order():
    # dev_matrix [2, 4]: rank = 4 * a + b; tensor_map [1, 0] cuts axis 0 by 2
    # (device axis 0) and axis 1 by 4
    layout = SliceLayout((2, 4), (1, 0))
    assert layout.cuts() == (2, 4)
    assert [layout.slice_of(r) for r in (0, 1, 4, 7)] == [
        (0, 0),
        (0, 1),
        (1, 0),
        (1, 3),
    ]
    assert SliceLayout((2, 4), (-1, 0)).slice_of(5) == (0, 1)


def strategy_file(tmp_path, dev, tmap, **fields) -> str:
    strategy = ParallelStrategyMap(current_stage=0)
    item = strategy.parallel_layout_item.add(param_name="backbone.layernorm.gamma")
    item.parallel_layouts.dev_matrix.add().dim.extend(dev)
    item.parallel_layouts.tensor_map.add().dim.extend(tmap)
    for k, v in fields.items():
        setattr(item.parallel_layouts, k, v)
    path = tmp_path / "s.ckpt"
    path.write_bytes(strategy.SerializeToString())
    return path


@pytest.mark.parametrize(
    "dev, tmap, fields, message",
    [
        ([2, 2], [2], {}, "names no axis"),
        ([2, 2], [0, 0], {}, "names no axis"),  # one device axis cutting twice
        ([0, 2], [0], {}, "device matrix (0, 2)"),
        ([2], [0], {"opt_weight_shard_size": 2}, "also cut by the optimizer"),
    ],
)
def test_bad_strategy_files_are_one_line(dev, tmap, fields, message, tmp_path):
    with pytest.raises(
        ValueError, match=message.replace("(", r"\(").replace(")", r"\)")
    ):
        read_strategy(strategy_file(tmp_path, dev, tmap, **fields))


@pytest.mark.parametrize(
    "content, message",
    [(b'{"parallel_layout_item": {}}', "JSON strategy"), (b"\xff\xff\xff", "not a")],
)
def test_foreign_strategy_files_are_refused(content, message, tmp_path):
    path = tmp_path / "s.ckpt"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=message):
        read_strategy(path)


@pytest.mark.parametrize("path", ["/dev/zero", "."])
def test_a_strategy_that_is_no_file_is_refused_unread(path):
    with pytest.raises(ValueError, match="no such strategy file"):
        read_strategy(path)  # /dev/zero would be read forever


def test_rank_order_needs_every_path_to_name_a_rank():
    assert rank_order(["r/rank_10/a", "r/rank_2/a"]) == ["r/rank_2/a", "r/rank_10/a"]
    assert rank_order(["b.ckpt", "a.ckpt"]) == ["b.ckpt", "a.ckpt"]  # as given
    assert rank_order(["rank_1/a", "x/a"]) == ["rank_1/a", "x/a"]
