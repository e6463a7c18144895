"""Partitions and segments: each party builds only its part, initialised as
the whole model would be, and the chained segments are the whole model."""

from __future__ import annotations

import pytest
import torch

from aisyn.model.causal_lm import document_index, eod_reset_masks, masks_from_documents
from aisyn.model.families import build_model
from aisyn.model.segments import (
    PartitionError,
    build_party_model,
    own_named_parameters,
    own_state_dict,
    parse_partition,
    segments_of,
)


@pytest.mark.parametrize("spec", ["u:0,0", "u:1,1", "u:2,0", "u:0,3"])
def test_u_shape_parties_rebuild_the_unsplit_model(split_config, spec):
    # Prepare
    full = build_model(split_config, seed=5)
    part = parse_partition(spec, split_config)
    a = build_party_model(split_config, part, "A", seed=5)
    b = build_party_model(split_config, part, "B", seed=5)
    tokens = torch.randint(0, split_config.vocab_size, (2, 24))
    # Execute
    front, back = segments_of(a, part, "A")
    (middle,) = segments_of(b, part, "B")
    logits = back.logits(back(middle(front(tokens))))
    # Assert: same weights, disjoint halves covering the model, same function
    sa, sb = own_state_dict(a, part, "A"), own_state_dict(b, part, "B")
    assert not set(sa) & set(sb)
    full_sd = full.state_dict()
    assert set(sa) | set(sb) == set(full_sd) - {"lm_head.weight"}
    for name, t in {**sa, **sb}.items():
        assert torch.equal(t, full_sd[name]), name
    assert torch.equal(logits, full(tokens))
    # B never materialises the embedding or the head
    assert b.transformer.wte.weight.is_meta and b.transformer.wqe.weight.is_meta
    assert a.lm_head.weight is a.transformer.wte.weight  # tied on A
    n_a = sum(p.numel() for _, p in own_named_parameters(a, part, "A"))
    n_b = sum(p.numel() for _, p in own_named_parameters(b, part, "B"))
    assert n_a + n_b == full.num_parameters()


def test_two_way_cut_puts_head_and_a_tied_copy_on_b(split_config):
    part = parse_partition("two-way:2", split_config)
    b = build_party_model(split_config, part, "B", seed=1)
    full = build_model(split_config, seed=1)
    assert [s.party for s in part.stages] == ["A", "B"]
    assert part.shared_parameter_names(b) == ["transformer.wte.weight"]
    assert torch.equal(b.lm_head.weight, full.lm_head.weight)
    assert b.transformer.h[0].ln_1.weight.is_meta  # A's block stays unbuilt
    assert "B: h[2:4] + ln_f + top query h[4] + head" in part.describe()


@pytest.mark.parametrize(
    "spec,match",
    [
        ("u:2,2", "B would hold no block"),
        ("u:4,0", "B would hold no block"),
        ("x:1", "expected 'u:FRONT,BACK'"),
        ("u:-1,0", "expected 'u:FRONT,BACK'"),
        ("two-way:4", "B would hold no block"),
    ],
)
def test_bad_cuts_are_rejected(split_config, spec, match):
    with pytest.raises(PartitionError, match=match):
        parse_partition(spec, split_config)


def test_document_index_gives_the_eod_reset_masks():
    """B gets per-position document indices, never tokens, and derives the
    same mask and positions as the unsplit model does from the tokens."""
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(3, 50, (3, 40), generator=g)
    tokens[0, [5, 6, 20]] = 2  # adjacent EODs and a late one
    tokens[1, 0] = 2
    tokens[2, -1] = 2
    mask, pos = eod_reset_masks(tokens, 2)
    got_mask, got_pos = masks_from_documents(document_index(tokens, 2))
    assert torch.equal(got_mask, mask)
    assert torch.equal(got_pos, pos)
