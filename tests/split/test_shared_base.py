"""One frozen base for every LoRA session of a compute centre (issue 21,
deliverable 2): the centre reads B's tensors of the base once and each LoRA
session's blocks are views of that one copy, its adapters and their optimizer
state its own; each tenant's steps are still its solo run's, and the base is
bit for bit what was read."""

from __future__ import annotations

import logging
import threading

import pytest
import torch
from conftest import CUT, losses, server_settings
from test_finetune import LORA, REL, ft_cfg, lora_split
from test_split_generate import SAMPLINGS, assert_same, split
from test_tenants import Centre, client, fingerprint

from aisyn.link.certs import make_dev_certs
from aisyn.model.segments import COMPUTE_PARTY, parse_partition
from aisyn.split.backbone.compute_party import ComputeParty
from aisyn.split.centre.tenants import load_tenants
from aisyn.split.client.train import split_train
from aisyn.split.party import PartyState, place_weights
from aisyn.split.session import SplitOptions
from aisyn.train import checkpoint as ckpt

NAMES = ("alice", "bob", "carol")
GREEDY = SAMPLINGS["greedy"]


def test_lora_sessions_hold_one_copy_of_the_base(ft_config, ft_base):
    base = ft_base
    party = ComputeParty(
        ft_config, parse_partition(CUT, ft_config), None, init_from=base
    )
    frozen = party.frozen_base(ft_config)
    assert party.frozen_base(ft_config) is frozen  # read once
    states = []
    for seed in (1, 2):
        state = PartyState(
            ft_config,
            party.partition,
            COMPUTE_PARTY,
            ft_cfg(),
            torch.device("cpu"),
            method=LORA,
            lora_seeds={n: seed for n in party.lora_a_names(LORA)},
            frozen=frozen,
        )
        place_weights(state, party.base, None, fresh_train=True)
        states.append(state)
    before = {n: t.clone() for n, t in frozen.items()}
    for state in states:
        params = dict(state.model.named_parameters())
        for name, t in frozen.items():
            # peft moved an adapted layer's weight under .base_layer
            prefix, _, leaf = name.rpartition(".")
            shared = params.get(name, params.get(f"{prefix}.base_layer.{leaf}"))
            assert shared is not None, name
            assert shared.data_ptr() == t.data_ptr() and not shared.requires_grad
        assert all(".lora_" in n for n, _ in state.named)
    a, b = (dict(s.named) for s in states)
    assert not any(a[n].data_ptr() == b[n].data_ptr() for n in a)
    # Train one session a step: the base does not move, the other's adapters
    # do not either.
    x = torch.randn(2, ft_config.seq_len, ft_config.hidden_size, requires_grad=True)
    (middle,) = states[0].segments
    middle(x, None).square().mean().backward()
    b_before = {n: t.clone() for n, t in b.items()}
    states[0].apply_step(0, 0.0, states[0].local_sq_norm())
    assert all(torch.equal(frozen[n], before[n]) for n in frozen)
    assert all(torch.equal(b[n], b_before[n]) for n in b)
    on_disk = ckpt.read_tensors(ckpt.model_file(base))
    assert all(torch.equal(frozen[n], on_disk[n]) for n in frozen)


@pytest.mark.heavy
@pytest.mark.parametrize("batched", [False, True], ids=["own-passes", "batched"])
def test_three_tenants_fine_tune_lora_at_once_on_one_base(
    tmp_path, ft_config, ft_base, ft_sft_dir, token_file, caplog, batched
):
    """``batched``: their micro-batches that wait at once go through the base
    together (``split.centre.tenant_batch``)."""
    caplog.set_level(logging.INFO, logger="aisyn.split.backbone.compute_party")
    base, sft_dir = ft_base, ft_sft_dir
    # Prepare: the solo run each tenant's must equal, and the centre
    lora_split(tmp_path / "solo", ft_config, base, sft_dir)
    caplog.clear()  # the solo run's own compute party held the base too
    pki = make_dev_certs(tmp_path / "pki", more_clients=["bob", "carol"])
    certs = {
        "alice": pki.client_cert,
        **{n: pki.other_client(n)[0] for n in ("bob", "carol")},
    }
    (tmp_path / "tenants.toml").write_text(
        "".join(
            f'[tenant.{n}]\ncertificate = "{fingerprint(c)}"\n'
            for n, c in certs.items()
        )
    )
    tenants = load_tenants(tmp_path / "tenants.toml")
    listen = server_settings(pki, token_file)
    with Centre(
        ft_config, tmp_path / "b", listen, tenants, init_from=base, max_sessions=3
    ) as centre:
        centre.party.batch_tenants = batched
        errors: dict[str, BaseException] = {}

        def tenant(name: str) -> None:
            peer = client(pki, centre.server.address, name, token_file)
            try:
                split_train(
                    ft_config,
                    [sft_dir],
                    tmp_path / name,
                    ft_cfg(),
                    SplitOptions(cut=CUT, mode="grpc", window=2, peer=peer),
                    sft=True,
                    init_from=base,
                    progress=False,
                    method=LORA,
                    compute_method=LORA,
                )
            except BaseException as e:  # reported below
                errors[name] = e

        threads = [threading.Thread(target=tenant, args=(n,)) for n in NAMES]
        for t in threads:
            t.start()
        for t in threads:
            t.join(240)
        assert errors == {}
        batchers = list(centre.party._batchers.values())
        if batched:  # every training micro-batch went the batched way
            (batcher,) = batchers
            assert batcher.batched_rows == 3 * ft_cfg().steps * ft_cfg().grad_accum
        else:
            assert batchers == []
        # Then each generates from its run with its own adapters: alone, and
        # all three at once (deliverable 6)
        peers = {n: client(pki, centre.server.address, n, token_file) for n in NAMES}
        alone = {
            n: split(tmp_path / n, GREEDY, peer=peers[n], mode="grpc") for n in NAMES
        }
        together: dict[str, object] = {}

        def generate(name: str) -> None:
            try:
                together[name] = split(
                    tmp_path / name, GREEDY, peer=peers[name], mode="grpc"
                )
            except BaseException as e:  # reported below
                together[name] = e

        threads = [threading.Thread(target=generate, args=(n,)) for n in NAMES]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    for name in NAMES:
        assert_same(together[name], alone[name])
    for name in NAMES:
        assert losses(tmp_path / name) == pytest.approx(
            losses(tmp_path / "solo"), rel=REL
        )
    # B read its tensors of the base once, for all three
    held = [r for r in caplog.records if "holding the base's" in r.getMessage()]
    assert len(held) == 1
