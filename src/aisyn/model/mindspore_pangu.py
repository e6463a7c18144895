"""PanGu-α's MindSpore parameter names, mapped to ours and back.

Where the names come from (all public source):

* the official MindSpore model, mindspore-ai/models
  ``official/nlp/Pangu_alpha/src/pangu_alpha.py``: ``PanguAlphaModel`` holds
  ``backbone`` (``PanguAlpha_Model``: ``embedding.word_embedding`` and
  ``embedding.position_embedding``, ``blocks.{i}`` for the first
  ``num_layers - 1`` layers, ``layernorm``, ``top_query_embedding``,
  ``top_query_layer``) and a parameterless head that multiplies by the word
  embedding table (tied, as ours). ``PanGUAlphaWithLoss`` and the training
  wrappers are built with ``auto_prefix=False``, so names start at
  ``backbone.``; the optimizer (``src/adam.py``) adds ``adam_m.*`` and
  ``adam_v.*`` copies, the wrappers ``global_step``, ``loss_scale`` and the
  like, the checkpoint callback ``epoch_num`` and ``step_num``.
* the layers, from MindSpore's ``nn.transformer`` (1.6-1.8; mindformers'
  ``modules/transformer`` after it): ``VocabEmbedding.embedding_table``;
  ``TransformerEncoderLayer`` = ``layernorm1``, ``attention``
  (``MultiHeadAttention``: ``dense1/2/3`` query/key/value, ``projection``),
  ``layernorm2``, ``output`` (``FeedForward``: ``mapping``, ``projection``);
  ``_LayerNorm`` holds ``gamma`` and ``beta`` (eps 1e-5). ``_Linear`` stores
  its weight ``[out, in]`` by default, but ``[in, out]`` with
  ``transpose_b=False``, which the attention ``projection`` and both FFN
  layers use: those three are transposed on the way in and out. (All square
  for the attention, so a wrong guess would not show in any shape.)
* the split reference, mindspore-ai/federated
  ``example/splitnn_pangu_alpha/src/split_pangu_alpha.py``: its three
  sub-networks save ``word_embedding.*`` / ``position_embedding.*``
  (``EmbeddingLayer``), ``blocks.{i}.*`` and ``layernorm.*``,
  ``top_query_embedding.*``, ``top_query_layer.*`` (``HeadLossNet``), i.e. the
  same names without ``backbone.`` and ``embedding.``. Names are compared
  after dropping those two prefixes, so these files load too, given together.
* older and other savers' names for the three embeddings (``ALIASES``): the
  r1.3 model_zoo's ``embedding_table``,
  ``backbone.embedding.embedding.position_embedding.embedding_table`` and
  ``backbone.top_query_embedding_table``; mindformers' ``convert_weight.py``
  and ``PanguAlpha_Model.load_embedding_from_ckpt``'s
  ``word_embedding_table``, ``position_embedding_table`` and
  ``query_embedding_table``. The r1.3 pipeline model keeps its top query layer
  as the last of its ``blocks``: with no ``top_query_layer.*`` tensor, the
  highest block is it.

MindSpore's PanGu-α uses ``fast_gelu`` (x * sigmoid(1.702 x)) where our
presets use the exact GELU: ``infer_config`` sets ``activation="fast_gelu"``,
so a converted model computes what the original did. It still computes in
float32 where MindSpore's ran in float16: logits agree closely, not bit for
bit.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping

import torch

from aisyn.model.pangu import CONFIGS, PanguConfig

log = logging.getLogger(__name__)

#: MindSpore's layer leaves -> ours, and whether the weight is stored [in, out]
LAYER_LEAVES: dict[str, tuple[str, bool]] = {
    "layernorm1.gamma": ("ln_1.weight", False),
    "layernorm1.beta": ("ln_1.bias", False),
    "attention.dense1.weight": ("attn.q_proj.weight", False),
    "attention.dense1.bias": ("attn.q_proj.bias", False),
    "attention.dense2.weight": ("attn.k_proj.weight", False),
    "attention.dense2.bias": ("attn.k_proj.bias", False),
    "attention.dense3.weight": ("attn.v_proj.weight", False),
    "attention.dense3.bias": ("attn.v_proj.bias", False),
    "attention.projection.weight": ("attn.c_proj.weight", True),
    "attention.projection.bias": ("attn.c_proj.bias", False),
    "layernorm2.gamma": ("ln_2.weight", False),
    "layernorm2.beta": ("ln_2.bias", False),
    "output.mapping.weight": ("mlp.c_fc.weight", True),
    "output.mapping.bias": ("mlp.c_fc.bias", False),
    "output.projection.weight": ("mlp.c_proj.weight", True),
    "output.projection.bias": ("mlp.c_proj.bias", False),
}
#: the model's other tensors, by their short names (see ``short_name``)
TOP_LEVEL: dict[str, str] = {
    "word_embedding.embedding_table": "transformer.wte.weight",
    "position_embedding.embedding_table": "transformer.wpe.weight",
    "top_query_embedding.embedding_table": "transformer.wqe.weight",
    "layernorm.gamma": "transformer.ln_f.weight",
    "layernorm.beta": "transformer.ln_f.bias",
}
#: training state a checkpoint may carry beside the weights; ignored knowingly
IGNORED_PREFIXES = ("adam_m.", "adam_v.", "moment1.", "moment2.", "accu_grads.")
IGNORED_NAMES = frozenset(
    {
        # the released checkpoints' loop state (mindformers' callbacks)
        "has_trained_step",
        "has_trained_epoch",
        "cur_epoch_num",
        "cur_step_num",
        "data_start_index",
        "loss_scale_value",
        "global_step",
        "learning_rate",
        "loss_scale",
        "scale_sense",
        "current_iterator_step",
        "last_overflow_iterator_step",
        "epoch_num",
        "step_num",
        "beta1_power",
        "beta2_power",
    }
)
#: incremental-inference caches (``use_past``), state rather than weights
IGNORED_SUFFIXES = (".key_past", ".value_past")

#: other savers' short names of the embeddings -> ours (see the module doc)
ALIASES: dict[str, str] = {
    "embedding_table": "word_embedding.embedding_table",
    "word_embedding_table": "word_embedding.embedding_table",
    "embedding.position_embedding.embedding_table": (
        "position_embedding.embedding_table"
    ),
    "position_embedding_table": "position_embedding.embedding_table",
    "top_query_embedding_table": "top_query_embedding.embedding_table",
    "query_embedding_table": "top_query_embedding.embedding_table",
}

_BLOCK = re.compile(r"blocks\.(\d+)\.(.+)")

#: attention heads of the reference sizes, by hidden size: heads leave no trace
#: in any weight's shape, so they cannot be read from a checkpoint
REFERENCE_HEADS = {
    CONFIGS[name]["hidden_size"]: CONFIGS[name]["num_heads"]
    for name in ("350M", "2.6B", "13B", "200B")
}


def is_training_state(name: str) -> bool:
    """Whether ``name`` is optimizer or loop state rather than a weight."""
    return (
        name.startswith(IGNORED_PREFIXES)
        or name in IGNORED_NAMES
        or name.endswith(IGNORED_SUFFIXES)
    )


def short_name(name: str) -> str:
    """``name`` without the ``backbone.`` and ``embedding.`` prefixes that the
    whole model has and the split reference's files do not, under our name
    for it where another saver's differs (``ALIASES``)."""
    short = name.removeprefix("backbone.").removeprefix("embedding.")
    return ALIASES.get(short, short)


def our_name(short: str, num_blocks: int) -> tuple[str, bool] | None:
    """Our name for a MindSpore short name, and whether to transpose; None if
    the name is not one of PanGu-α's."""
    if short in TOP_LEVEL:
        return TOP_LEVEL[short], False
    if (m := _BLOCK.fullmatch(short)) and m.group(2) in LAYER_LEAVES:
        leaf, transpose = LAYER_LEAVES[m.group(2)]
        return f"transformer.h.{int(m.group(1))}.{leaf}", transpose
    if short.startswith("top_query_layer."):
        rest = short.removeprefix("top_query_layer.")
        if rest in LAYER_LEAVES:
            leaf, transpose = LAYER_LEAVES[rest]
            return f"transformer.h.{num_blocks}.{leaf}", transpose
    return None


def gather_weights(
    sources: Mapping[str, Mapping[str, torch.Tensor | str]],
    skipped: list[str] | None = None,
) -> dict[str, torch.Tensor]:
    """The weights of several checkpoints (file -> its entries) as one model,
    keyed by short name; training state dropped (its names appended to
    ``skipped``). A weight in two files, or a name that is neither a weight
    nor training state, is refused.

    Training state is what ``is_training_state`` names, plus any other tensor
    of at most one element that is no weight: loop counters and scales, which
    each trainer names its own way (a weight is never a single number).
    """
    found: dict[str, torch.Tensor] = {}
    where: dict[str, str] = {}
    for source, entries in sources.items():
        for name, value in entries.items():
            # Strings are append_info metadata (MindSpore stores no weight so)
            if is_training_state(name) or isinstance(value, str):
                if skipped is not None:
                    skipped.append(name)
                continue
            short = short_name(name)
            if our_name(short, 0) is None and value.numel() <= 1:
                if skipped is not None:
                    skipped.append(name)
                continue
            if our_name(short, 0) is None:
                raise ValueError(
                    f"{source}: {name} is not a PanGu-α parameter (nor optimizer "
                    "state); is this a PanGu-α checkpoint?"
                )
            if short in where:
                raise ValueError(
                    f"{source}: {name} is also in {where[short]}; give each tensor once"
                )
            found[short], where[short] = value, source
    return _top_layer_from_blocks(found)


def _top_layer_from_blocks(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The r1.3 pipeline model's names: with no ``top_query_layer.*`` but a
    top query embedding, the highest block is the top query layer."""
    if any(k.startswith("top_query_layer.") for k in weights):
        return weights
    if "top_query_embedding.embedding_table" not in weights:
        return weights  # a file of the split reference's, without its head
    blocks = [int(m.group(1)) for k in weights if (m := _BLOCK.fullmatch(k))]
    if not blocks:
        return weights
    top = f"blocks.{max(blocks)}."
    log.info("no top_query_layer.*: %s* taken for it (r1.3's pipeline model)", top)
    return {
        (f"top_query_layer.{k.removeprefix(top)}" if k.startswith(top) else k): v
        for k, v in weights.items()
    }


def infer_config(
    weights: Mapping[str, torch.Tensor], num_heads: int | None = None
) -> PanguConfig:
    """The ``PanguConfig`` that the shapes of ``weights`` (short names) describe.

    Heads are the one size no shape shows: ``num_heads`` if given, else the
    reference's for this hidden size (350M, 2.6B, 13B, 200B), else an error.
    """
    word = weights.get("word_embedding.embedding_table")
    position = weights.get("position_embedding.embedding_table")
    mapping = weights.get("top_query_layer.output.mapping.weight")
    for short, t in (
        ("word_embedding.embedding_table", word),
        ("position_embedding.embedding_table", position),
        ("top_query_layer.output.mapping.weight", mapping),
    ):
        if t is None:
            full = mindspore_name(our_name(short, 0)[0], 1)
            raise ValueError(f"missing tensor {full}; is every file given?")
        if t.dim() != 2:
            raise ValueError(f"{short} has shape {tuple(t.shape)}; expected a matrix")
    blocks = {int(m.group(1)) for k in weights if (m := _BLOCK.fullmatch(k))}
    num_blocks = max(blocks) + 1 if blocks else 0
    if len(blocks) != num_blocks:
        # Bounded by the tensors present, before anything is sized by it: a
        # lone "blocks.100000000.*" must not make a 10^8-layer model.
        gap = next(i for i in range(num_blocks) if i not in blocks)  # <= len
        raise ValueError(
            f"the checkpoint has blocks up to {num_blocks - 1} but none of block "
            f"{gap} ({len(blocks)} blocks in all); is every file given?"
        )
    vocab, hidden = word.shape
    if num_heads is None:
        num_heads = REFERENCE_HEADS.get(hidden)
        if num_heads is None:
            raise ValueError(
                f"hidden size {hidden} is none of the reference sizes', and a "
                "checkpoint does not record attention heads; pass --num-heads"
            )
    return PanguConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        num_layers=num_blocks + 1,
        num_heads=num_heads,
        ffn_size=mapping.shape[1],
        seq_len=position.shape[0],
        dropout=0.0,
        activation="fast_gelu",  # MindSpore's PanGu-α's FFN activation
    )


def to_state_dict(
    weights: Mapping[str, torch.Tensor], cfg: PanguConfig
) -> dict[str, torch.Tensor]:
    """Our state dict (float32, the tied ``lm_head`` left out) from MindSpore
    weights keyed by short name. Every tensor ``cfg`` needs must be there, in
    its shape; the first problem raises ``ValueError`` naming the tensor."""
    expected = expected_shapes(cfg)
    ours: dict[str, torch.Tensor] = {}
    for short, t in weights.items():
        mapped = our_name(short, cfg.num_layers - 1)
        name, transpose = mapped if mapped else (None, False)
        if name not in expected:
            raise ValueError(
                f"{short}: a layer this {cfg.num_layers}-layer model does not have "
                f"(blocks 0-{cfg.num_layers - 2} and the top query layer)"
            )
        shape = expected[name]
        stored = shape[::-1] if transpose else shape
        if tuple(t.shape) != stored:
            raise ValueError(
                f"{short} has shape {tuple(t.shape)}, expected {stored} for "
                f"hidden {cfg.hidden_size}, FFN {cfg.ffn_size}, vocab "
                f"{cfg.vocab_size}, {cfg.seq_len} positions"
            )
        if not t.is_floating_point():
            raise ValueError(f"{short} holds {t.dtype}, not floating-point weights")
        ours[name] = (t.T if transpose else t).to(torch.float32).contiguous()
    missing = [n for n in expected if n not in ours]
    if missing:
        raise ValueError(
            f"missing tensor {mindspore_name(missing[0], cfg.num_layers)} "
            f"({len(missing)} of {len(expected)} missing); is every file given?"
        )
    return ours


def to_mindspore(
    state: Mapping[str, torch.Tensor],
    cfg: PanguConfig,
    dtype: torch.dtype | None = None,
    dtypes: Mapping[str, torch.dtype] | None = None,
) -> dict[str, torch.Tensor]:
    """Our weights under the whole MindSpore model's names (``backbone.*``),
    FFN and attention-projection weights transposed back to ``[in, out]``,
    each cast to its entry in ``dtypes`` (our name, or its ``layer_pattern``)
    if it has one, else to ``dtype`` if given; in the order in which MindSpore
    saves ``PanguAlpha_Model``'s parameters (the order its cells are defined
    in): embeddings, final LayerNorm, blocks, top query embedding, top query
    layer."""
    names = list(expected_shapes(cfg))
    top = f"transformer.h.{cfg.num_layers - 1}."
    order = (
        [n for n in names if n.startswith(("transformer.wte", "transformer.wpe"))]
        + [n for n in names if n.startswith("transformer.ln_f")]
        + [n for n in names if n.startswith("transformer.h.") and not n.startswith(top)]
        + ["transformer.wqe.weight"]
        + [n for n in names if n.startswith(top)]
    )
    assert sorted(order) == sorted(names)
    dtypes = dtypes or {}
    out = {}
    for n in order:
        t = state[n].T if _transposed(n) else state[n]
        want = dtypes.get(n) or dtypes.get(layer_pattern(n)) or dtype or t.dtype
        # one copy at most: the cast writes row-major directly
        out[mindspore_name(n, cfg.num_layers)] = t.to(
            want, memory_format=torch.contiguous_format
        )
    return out


#: the dtypes a MindSpore export may be written in, by name
DTYPE_NAMES: dict[str, torch.dtype] = {
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
    "fp32": torch.float32,
}
_NAME_OF = {v: k for k, v in DTYPE_NAMES.items()}


def layer_pattern(name: str) -> str:
    """Our ``name`` with its layer index as ``*`` (``transformer.h.*.ln_1.weight``)."""
    return re.sub(r"^transformer\.h\.\d+\.", "transformer.h.*.", name)


def saved_dtypes(
    weights: Mapping[str, torch.Tensor], cfg: PanguConfig
) -> tuple[str, dict[str, str]]:
    """The dtypes ``weights`` (short names) were saved in, to write them back
    in: the one holding most elements, and the others' tensors by our name,
    or by ``layer_pattern`` where every layer agrees (the official PanGu-α
    keeps fp16 weights but fp32 LayerNorms: a strict MindSpore load wants
    each as it was). Float64 is recorded as fp32."""
    ours: dict[str, str] = {}
    count: dict[str, int] = {}
    for short, t in weights.items():
        mapped = our_name(short, cfg.num_layers - 1)
        if mapped is None or not t.is_floating_point():
            continue  # to_state_dict refuses these
        ours[mapped[0]] = kind = _NAME_OF.get(t.dtype, "fp32")
        count[kind] = count.get(kind, 0) + t.numel()
    if not count:
        return "fp32", {}
    main = max(count, key=count.__getitem__)
    by_pattern: dict[str, set[str]] = {}
    for name, kind in ours.items():
        by_pattern.setdefault(layer_pattern(name), set()).add(kind)
    others: dict[str, str] = {}
    for name, kind in ours.items():
        if kind == main:
            continue
        pattern = layer_pattern(name)
        others[pattern if by_pattern[pattern] == {kind} else name] = kind
    return main, others


def expected_shapes(cfg: PanguConfig) -> dict[str, tuple[int, ...]]:
    """Every weight of our model except the tied ``lm_head``, with its shape."""
    h, f = cfg.hidden_size, cfg.ffn_size
    shapes: dict[str, tuple[int, ...]] = {
        "transformer.wte.weight": (cfg.vocab_size, h),
        "transformer.wpe.weight": (cfg.seq_len, h),
        "transformer.wqe.weight": (cfg.seq_len, h),
    }
    per_layer: dict[str, tuple[int, ...]] = {"ln_1.weight": (h,), "ln_1.bias": (h,)}
    for proj in ("q_proj", "k_proj", "v_proj", "c_proj"):
        per_layer[f"attn.{proj}.weight"] = (h, h)
        per_layer[f"attn.{proj}.bias"] = (h,)
    per_layer |= {
        "ln_2.weight": (h,),
        "ln_2.bias": (h,),
        "mlp.c_fc.weight": (f, h),
        "mlp.c_fc.bias": (f,),
        "mlp.c_proj.weight": (h, f),
        "mlp.c_proj.bias": (h,),
    }
    for i in range(cfg.num_layers):
        shapes.update({f"transformer.h.{i}.{k}": s for k, s in per_layer.items()})
    shapes["transformer.ln_f.weight"] = (h,)
    shapes["transformer.ln_f.bias"] = (h,)
    return shapes


_OURS_TOP = {v: k for k, v in TOP_LEVEL.items()}
_OURS_LEAF = {v[0]: k for k, v in LAYER_LEAVES.items()}


def mindspore_name(name: str, num_layers: int) -> str:
    """The whole MindSpore model's name of our parameter ``name``."""
    if name in _OURS_TOP:
        short = _OURS_TOP[name]
        embedding = short.startswith(("word_", "position_"))
        return f"backbone.{'embedding.' if embedding else ''}{short}"
    m = re.fullmatch(r"transformer\.h\.(\d+)\.(.+)", name)
    assert m and m.group(2) in _OURS_LEAF, name
    layer = int(m.group(1))
    where = "top_query_layer" if layer == num_layers - 1 else f"blocks.{layer}"
    return f"backbone.{where}.{_OURS_LEAF[m.group(2)]}"


def _transposed(name: str) -> bool:
    leaf = name.split(".", 3)[-1]
    return leaf in {v[0] for v in LAYER_LEAVES.values() if v[1]}
