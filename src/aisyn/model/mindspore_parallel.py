"""Model-parallel rank files of one MindSpore PanGu-α checkpoint, merged.

The reference trains with model parallelism (mp = 8): MindSpore saves one
checkpoint per rank, and with ``integrated_save=False`` (the reference's
setting) a tensor that the model-parallel operators cut holds only the rank's
slice. ``merge_rank_files`` joins such files into one model's tensors:

* with MindSpore's parallel strategy file (``strategy_ckpt_save_file``), as
  MindSpore's own ``merge_sliced_parameter`` does: each parameter's device
  matrix and tensor map say which slice each rank holds (``tensor_map[i] = k``
  cuts axis ``i`` by ``dev_matrix[-1 - k]``; ranks enumerate the device matrix
  row-major); ranks holding the same slice (data parallelism) must agree;
* without one, from PanGu-α's known layout (``MP_AXES``; mindformers'
  ``MultiHeadAttention`` and ``FeedForward`` shards): the query, key and value
  projections and the FFN's first layer are cut by output, the attention and
  FFN output projections by input, the word embedding by vocabulary rows when
  the run used the vocabulary-parallel embedding (``word_emb_dp=0``);
  everything else is replicated. The files are then one model-parallel
  group's, ranks 0 .. mp-1.

Files are taken in rank order: the order of the rank numbers their paths name
(``rank_3/...``, as MindSpore's callbacks write them) when every path names
one, else the order given (MindSpore's ``load_distributed_checkpoint`` wants
them in rank order too). Tensors only one file holds (pipeline stages, the
split reference's parts) pass through untouched; the merged shapes are
checked against the model's config afterwards, like any file's.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from aisyn.model.mindspore_pangu import is_training_state, our_name, short_name
from aisyn.model.proto.mindspore_strategy_pb2 import ParallelStrategyMap

log = logging.getLogger(__name__)

#: the axis along which PanGu-α's model parallelism cuts a block's tensor, by
#: its leaf (weights as MindSpore stores them: dense1/2/3 [out, in], the
#: others [in, out])
MP_AXES: dict[str, int] = {
    "attention.dense1.weight": 0,
    "attention.dense1.bias": 0,
    "attention.dense2.weight": 0,
    "attention.dense2.bias": 0,
    "attention.dense3.weight": 0,
    "attention.dense3.bias": 0,
    "attention.projection.weight": 0,
    "output.mapping.weight": 1,
    "output.mapping.bias": 0,
    "output.projection.weight": 0,
}
#: leaves whose cut axis is the hidden size (the others' is the FFN size)
_HIDDEN_AXIS = {k for k in MP_AXES if k.startswith("attention.")}
WORD_EMBEDDING = "word_embedding.embedding_table"
#: a strategy file is a few KB per layer; anything far larger is not one
MAX_STRATEGY_BYTES = 256 << 20

_RANK = re.compile(r"rank[_-]?(\d+)", re.IGNORECASE)


@dataclass(frozen=True)
class SliceLayout:
    """How one parameter is cut: MindSpore's device matrix and tensor map."""

    dev_matrix: tuple[int, ...]
    tensor_map: tuple[int, ...]

    @property
    def ranks(self) -> int:
        return math.prod(self.dev_matrix)

    def cuts(self) -> tuple[int, ...]:
        """Slices along each tensor axis."""
        return tuple(1 if k == -1 else self.dev_matrix[-1 - k] for k in self.tensor_map)

    def slice_of(self, rank: int) -> tuple[int, ...]:
        """The slice index along each axis that ``rank`` holds."""
        coord = []
        for size in reversed(self.dev_matrix):  # row-major: the last is fastest
            rank, c = divmod(rank, size)
            coord.append(c)
        coord.reverse()
        return tuple(0 if k == -1 else coord[-1 - k] for k in self.tensor_map)


def read_strategy(path: str | Path) -> dict[str, SliceLayout]:
    """Each parameter's ``SliceLayout`` from a MindSpore strategy file.

    Raises ``ValueError`` with one line naming the problem.
    """
    path = Path(path)
    if not path.is_file():  # a folder, a device (/dev/zero never ends), nothing
        raise ValueError(f"{path}: no such strategy file")
    with path.open("rb") as f:
        data = f.read(MAX_STRATEGY_BYTES + 1)  # bounded even if the file grows
    if len(data) > MAX_STRATEGY_BYTES:
        raise ValueError(f"{path}: too large for a MindSpore strategy file")
    if data.lstrip()[:1] == b"{":
        raise ValueError(
            f"{path}: a JSON strategy file; give the protobuf one "
            "(strategy_ckpt_save_file ending in .ckpt)"
        )
    strategy = ParallelStrategyMap()
    try:
        strategy.ParseFromString(data)
    except Exception:  # protobuf's DecodeError, or upb's RuntimeError
        raise ValueError(f"{path}: not a MindSpore strategy file") from None
    layouts: dict[str, SliceLayout] = {}
    for item in strategy.parallel_layout_item:
        name, lay = item.param_name, item.parallel_layouts
        if not name or len(lay.dev_matrix) != 1 or len(lay.tensor_map) != 1:
            raise ValueError(
                f"{path}: parameter {name or '?'} has no single device matrix and "
                "tensor map; not a MindSpore strategy file?"
            )
        if lay.field or lay.opt_weight_shard_size > 1:
            raise ValueError(
                f"{path}: {name} is also cut by the optimizer "
                "(parallel_optimizer); merge the files with MindSpore "
                "(transform_checkpoints) first"
            )
        dev = tuple(lay.dev_matrix[0].dim)
        tmap = tuple(lay.tensor_map[0].dim)
        if not dev or any(d < 1 for d in dev) or math.prod(dev) > 1 << 20:
            raise ValueError(f"{path}: {name} has the device matrix {dev}")
        used = [k for k in tmap if k != -1]
        if any(not -1 <= k < len(dev) for k in tmap) or len(set(used)) < len(used):
            raise ValueError(
                f"{path}: {name}'s tensor map {tmap} names no axis of its device "
                f"matrix {dev}"
            )
        layouts[name] = SliceLayout(dev, tmap)
    if not layouts:
        raise ValueError(f"{path}: a strategy file without parameter layouts")
    return layouts


def rank_order(files: list[str]) -> list[str]:
    """``files`` in rank order: by the rank number each path names (the last
    ``rank_N`` in it), when every path names a different one; else as given."""
    ranks = []
    for f in files:
        found = _RANK.findall(str(f))
        ranks.append(int(found[-1]) if found else None)
    if None in ranks or len(set(ranks)) != len(ranks):
        return list(files)
    return [f for _, f in sorted(zip(ranks, files, strict=True))]


def merge_rank_files(
    sources: dict[str, dict[str, torch.Tensor | str]],
    strategy: Mapping[str, SliceLayout] | None = None,
) -> dict[str, dict[str, torch.Tensor | str]]:
    """Merge, in place, every weight that several of ``sources`` (file -> its
    entries) hold into one tensor, kept under the first rank's entries and
    dropped from the others' (in place, so that each tensor's slices are freed
    once it is merged: a model's weights are held about once, not twice); see
    the module doc. Training state and metadata are left as they are, for
    the caller to skip. Returns ``sources``.

    Raises ``ValueError`` naming the tensor and the files when they do not
    make one tensor.
    """
    order = rank_order(list(sources))
    holders: dict[str, list[tuple[str, str]]] = {}  # short -> [(file, tag)]
    for source in order:
        for name, value in sources[source].items():
            short = short_name(name)
            # what is no weight (loop state, foreign names) is gather_weights'
            # to skip or refuse; only weights are merged
            if isinstance(value, str) or is_training_state(name):
                continue
            if our_name(short, 0) is None:
                continue
            holders.setdefault(short, []).append((source, name))
    # one file holding a weight twice (two savers' names for it) is no rank
    # set: gather_weights refuses it
    shared = {
        s: h
        for s, h in holders.items()
        if len(h) > 1 and len({f for f, _ in h}) == len(h)
    }
    if not shared:
        return sources
    by_short = {short_name(n): lay for n, lay in (strategy or {}).items()}
    hidden = _hidden_size(sources, holders)
    cut_ffn = None if strategy else _attention_is_cut(sources, shared, hidden)
    for short, held in shared.items():
        slices = [sources[f][tag] for f, tag in held]
        where = f"{held[0][1]} (in {len(held)} files)"
        if strategy is not None:
            layout = strategy.get(held[0][1]) or by_short.get(short)
            merged = (
                _merge_by_layout(slices, layout, where)
                if layout is not None
                else _replicated(slices, where)  # the strategy cuts it nowhere
            )
        else:
            axis = _layout_axis(short, slices, hidden, cut_ffn)
            merged = _concat(slices, axis, where) if axis is not None else None
            if merged is None:
                merged = _replicated(slices, where)
        del slices
        first, tag = held[0]
        sources[first][tag] = merged
        for f, t in held[1:]:
            del sources[f][t]
    how = "the strategy file" if strategy else "PanGu-α's model-parallel layout"
    log.info(
        "merged %d tensors held by several of %d files, by %s",
        len(shared),
        len(sources),
        how,
    )
    return sources


def _hidden_size(sources, holders) -> int | None:
    """The hidden size, from a LayerNorm (never cut): None if there is none."""
    for short, held in holders.items():
        if short.endswith(("layernorm.gamma", "layernorm1.gamma")):
            f, tag = held[0]
            t = sources[f][tag]
            if t.dim() == 1:
                return t.shape[0]
    return None


def _attention_is_cut(sources, shared, hidden: int | None) -> bool | None:
    """Whether these files are model-parallel slices: the witness is the query
    projection, whose rows (the hidden size, known from a LayerNorm) a cut
    divides. The FFN is cut exactly when the attention is."""
    if hidden is None:
        return None
    for short, held in shared.items():
        if short.endswith("attention.dense1.weight"):
            f, tag = held[0]
            return sources[f][tag].shape[0] != hidden
    return None


def _layout_axis(
    short: str, slices: list[torch.Tensor], hidden: int | None, cut_ffn: bool | None
) -> int | None:
    """The axis to join ``slices`` of ``short`` along, or None: replicated."""
    if short == WORD_EMBEDDING:
        # vocabulary-parallel or not is a run's choice (word_emb_dp); random
        # rows of different ranks are never equal, a replicated table's are
        # (only ever with model parallelism: files whose attention is whole
        # hold whole tables, and differing ones are no one model's)
        same = all(torch.equal(slices[0], t) for t in slices[1:])
        return None if same or cut_ffn is False else 0
    leaf = short.split(".", 2)[-1] if short.startswith("blocks.") else short
    leaf = leaf.removeprefix("top_query_layer.")
    axis = MP_AXES.get(leaf)
    if axis is None or slices[0].dim() <= axis:
        return None
    if leaf in _HIDDEN_AXIS and hidden is not None:
        return axis if slices[0].shape[axis] != hidden else None
    if cut_ffn is not None:
        return axis if cut_ffn else None
    same = all(torch.equal(slices[0], t) for t in slices[1:])
    return None if same else axis


def _same_dtype(slices: list[torch.Tensor], where: str) -> None:
    # torch.cat would promote mixed dtypes silently; no MindSpore run mixes them
    dtypes = {t.dtype for t in slices}
    if len(dtypes) != 1:
        names = sorted(str(d).removeprefix("torch.") for d in dtypes)
        raise ValueError(f"{where}: the files hold it as {' and '.join(names)}")


def _concat(slices: list[torch.Tensor], axis: int, where: str) -> torch.Tensor:
    _same_dtype(slices, where)
    shapes = {tuple(t.shape) for t in slices}
    if len(shapes) != 1:
        raise ValueError(
            f"{where}: the rank files hold slices of different shapes "
            f"{sorted(shapes)}; not one model-parallel group's files"
        )
    return torch.cat(slices, dim=axis)


def _replicated(slices: list[torch.Tensor], where: str) -> torch.Tensor:
    _same_dtype(slices, where)
    for t in slices[1:]:
        if t.shape != slices[0].shape or not torch.equal(t, slices[0]):
            raise ValueError(
                f"{where}: the files hold different values of a tensor that "
                "model parallelism does not cut; files of different models or "
                "steps? (a model-parallel run's files: give its --strategy file, "
                "or one model-parallel group's files in rank order)"
            )
    return slices[0]


def _merge_by_layout(
    slices: list[torch.Tensor], layout: SliceLayout, where: str
) -> torch.Tensor:
    """The whole tensor from each rank's slice, as MindSpore's strategy says."""
    if len(slices) != layout.ranks:
        raise ValueError(
            f"{where}: the strategy file's device matrix {layout.dev_matrix} has "
            f"{layout.ranks} ranks, but {len(slices)} files hold the tensor"
        )
    part = tuple(slices[0].shape)
    if len(layout.tensor_map) != len(part):
        raise ValueError(
            f"{where}: the strategy file maps {len(layout.tensor_map)} axes, the "
            f"tensor has {len(part)}"
        )
    cuts = layout.cuts()
    whole = torch.empty(
        [p * c for p, c in zip(part, cuts, strict=True)], dtype=slices[0].dtype
    )
    placed: dict[tuple[int, ...], torch.Tensor] = {}
    for rank, t in enumerate(slices):
        if tuple(t.shape) != part or t.dtype != slices[0].dtype:
            raise ValueError(
                f"{where}: rank {rank}'s slice is {tuple(t.shape)} {t.dtype}, rank "
                f"0's {part} {slices[0].dtype}"
            )
        index = layout.slice_of(rank)
        if index in placed:
            if not torch.equal(placed[index], t):
                raise ValueError(
                    f"{where}: ranks holding the same slice (data parallelism) "
                    f"disagree (rank {rank}); files of different steps?"
                )
            continue
        placed[index] = t
        region = tuple(
            slice(i * p, (i + 1) * p) for i, p in zip(index, part, strict=True)
        )
        whole[region] = t
    if len(placed) != math.prod(cuts):  # parts of ``whole`` nobody wrote
        raise ValueError(
            f"{where}: the strategy's {layout.ranks} ranks hold {len(placed)} of "
            f"the {math.prod(cuts)} slices its tensor map cuts"
        )
    return whole
