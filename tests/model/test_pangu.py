import pytest
import torch

from aisyn.model.causal_lm import eod_reset_masks
from aisyn.model.families import build_model, load_config
from aisyn.model.pangu import CONFIGS, PanguConfig


def test_shapes_and_tied_head(tiny_config):
    model = build_model(tiny_config, seed=0)
    tokens = torch.randint(0, tiny_config.vocab_size, (2, 16))

    logits = model(tokens)

    assert logits.shape == (2, 16, tiny_config.vocab_size)
    assert model.lm_head.weight is model.transformer.wte.weight


def test_causal_future_tokens_do_not_change_past_logits(tiny_config):
    model = build_model(tiny_config, seed=0).eval()
    a = torch.randint(0, 8000, (1, 12))
    b = a.clone()
    b[0, 8:] = torch.randint(0, 8000, (4,))

    la, lb = model(a), model(b)

    torch.testing.assert_close(la[:, :8], lb[:, :8])
    assert not torch.allclose(la[:, 8:], lb[:, 8:])


def test_top_query_layer_reads_the_query_embedding(tiny_config):
    model = build_model(tiny_config, seed=0).eval()
    tokens = torch.randint(0, 8000, (1, 8))
    before = model(tokens)

    with torch.no_grad():
        model.transformer.wqe.weight[3] += 20.0
    after = model(tokens)

    # Only position 3's query changed, so only position 3's output moves.
    changed = (before - after).abs().amax(-1)[0]
    assert changed[3] > 1e-5
    assert torch.all(changed[torch.arange(8) != 3] == 0)


def test_eod_reset_masks_and_positions():
    eod = 7
    tokens = torch.tensor([[1, 2, eod, 3, 4, eod, 5]])

    mask, pos = eod_reset_masks(tokens, eod)

    assert pos.tolist() == [[0, 1, 2, 0, 1, 2, 0]]
    m = mask[0, 0]
    assert m[4].tolist() == [False, False, False, True, True, False, False]
    assert m[2].tolist() == [True, True, True, False, False, False, False]
    assert not m.triu(1).any()  # still causal


def test_eod_reset_isolates_documents(tiny_config):
    """With reset masks, a document's logits don't depend on the one before it."""
    model = build_model(tiny_config, seed=0).eval()
    eod = 1
    doc = torch.tensor([11, 12, 13, 14])
    a = torch.cat([torch.tensor([20, 21, eod]), doc]).unsqueeze(0)
    b = torch.cat([torch.tensor([30, 31, eod]), doc]).unsqueeze(0)

    la = model(a, *eod_reset_masks(a, eod))
    lb = model(b, *eod_reset_masks(b, eod))

    torch.testing.assert_close(la[:, 3:], lb[:, 3:])


def test_state_dict_names_follow_the_public_port(tiny_config):
    names = set(build_model(tiny_config).state_dict())

    for expected in [
        "transformer.wte.weight",
        "transformer.wpe.weight",
        "transformer.wqe.weight",
        "transformer.h.0.ln_1.weight",
        "transformer.h.0.attn.q_proj.weight",
        "transformer.h.0.attn.k_proj.bias",
        "transformer.h.0.attn.v_proj.weight",
        "transformer.h.0.attn.c_proj.weight",
        "transformer.h.0.ln_2.bias",
        "transformer.h.0.mlp.c_fc.weight",
        "transformer.h.2.mlp.c_proj.weight",
        "transformer.ln_f.weight",
        "lm_head.weight",
    ]:
        assert expected in names


@pytest.mark.parametrize(
    "name,billions",
    [("350M", 0.369), ("2.6B", 2.625), ("13B", 12.80), ("200B", 206.86)],
)
def test_reference_presets_on_meta_device(name, billions):
    model = build_model(name, device="meta")

    assert all(p.is_meta for p in model.parameters())
    assert model.num_parameters() / 1e9 == pytest.approx(billions, rel=1e-3)


def test_seeded_init_is_reproducible_and_per_parameter(tiny_config):
    a, b = build_model(tiny_config, seed=5), build_model(tiny_config, seed=5)
    c = build_model(tiny_config, seed=6)
    meta = build_model(tiny_config, device="meta")
    meta.to_empty(device="cpu")
    meta.tie_weights()
    own = [n for n, _ in meta.named_parameters() if ".h.1." in n]

    meta.reset_parameters(5, names=own)

    for (n, pa), pb in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(pa, pb), n
    assert not torch.equal(a.transformer.wte.weight, c.transformer.wte.weight)
    torch.testing.assert_close(
        meta.transformer.h[1].mlp.c_fc.weight,
        a.transformer.h[1].mlp.c_fc.weight,
        rtol=0,
        atol=0,
    )


def test_bad_configs_are_refused(tmp_path):
    with pytest.raises(ValueError, match="not divisible by num_heads"):
        PanguConfig(hidden_size=100, num_heads=3)
    bad = tmp_path / "cfg.json"
    bad.write_text('{"hidden_size": 64, "num_heads": 5}')
    with pytest.raises(ValueError, match="cfg.json.*not divisible"):
        load_config(bad)
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_config(bad)
    with pytest.raises(ValueError, match="neither a preset"):
        load_config("huge")


def test_json_config_file(tmp_path):
    path = tmp_path / "m.json"
    path.write_text(
        '{"vocab_size": 100, "hidden_size": 16, "num_layers": 2, '
        '"num_heads": 2, "ffn_size": 32, "seq_len": 8}'
    )

    cfg = load_config(path)

    assert cfg.hidden_size == 16 and cfg.num_layers == 2
    assert set(CONFIGS) >= {"tiny", "small", "350M", "2.6B", "13B", "200B"}


def test_sequence_longer_than_positions_is_refused(tiny_config):
    model = build_model(tiny_config)
    with pytest.raises(ValueError, match="exceeds the model's seq_len"):
        model(torch.zeros(1, tiny_config.seq_len + 1, dtype=torch.long))
