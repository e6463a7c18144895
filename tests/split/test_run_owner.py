"""A run at the compute party is bound to the data party that created it
(issue 17, item 10): another holder of the server's credentials who knows the
run id can neither train, resume, evaluate nor generate from it, and its
attempt leaves B's run folder as it was; the owner still resumes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import CUT, server_settings, start_server, train_cfg
from test_server_hardening import fresh_hello

from aisyn.link.certs import make_dev_certs
from aisyn.link.errors import HandshakeError
from aisyn.link.memory import IN_PROCESS
from aisyn.model.segments import parse_partition
from aisyn.split import protocol as proto
from aisyn.split.backbone.compute_party import OWNER, ComputeParty
from aisyn.split.client.train import split_train
from aisyn.split.session import SplitOptions, open_grpc
from aisyn.split.transport import LinkSettings


def snapshot(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def other_hellos(cfg, run_id: str) -> dict[str, dict]:
    """What a stranger who knows ``run_id`` would try."""
    fresh = fresh_hello(cfg, run_id)
    resume = {**fresh, "resume": True, "a_steps": [2]}
    partition = parse_partition(CUT, cfg)
    looks = {
        purpose: proto.hello(
            purpose=purpose,
            run_id=run_id,
            model=cfg.to_dict(),
            partition=partition.to_dict(),
            train=train_cfg(),
            eval_step=2,
        )
        for purpose in ("eval", "generate")
    }
    return {"train": fresh, "resume": resume, **looks}


@pytest.mark.heavy
def test_a_run_is_refused_to_another_certificate_and_kept_for_its_owner(
    tmp_path, split_config, news_data, token_file
):
    # Two data parties with certificates from the CA B trusts, and one token.
    certs = make_dev_certs(tmp_path / "certs", more_clients=["other"])
    listen = server_settings(certs, token_file)
    b_root = tmp_path / "b"
    with start_server(split_config, b_root, listen) as server:

        def client(cert: Path, key: Path) -> LinkSettings:
            return LinkSettings(
                server.address,
                tls_cert=str(cert),
                tls_key=str(key),
                tls_ca=str(certs.ca_cert),
                token_file=str(token_file),  # the same token
            )

        ours = client(certs.client_cert, certs.client_key)
        theirs = client(*certs.other_client("other"))
        opts = SplitOptions(cut=CUT, mode="grpc", peer=ours)
        out = tmp_path / "a"
        split_train(
            split_config,
            [news_data],
            out,
            train_cfg(steps=2, ckpt_every=2),
            opts,
            progress=False,
        )
        run_id = json.loads((out / "config.json").read_text())["run_id"]
        bound = json.loads((b_root / run_id / "config.json").read_text())[OWNER]
        assert bound.startswith("x509-sha256:") and len(bound) == 12 + 64
        before = snapshot(b_root)

        for what, hello in other_hellos(split_config, run_id).items():
            with pytest.raises(HandshakeError, match="belongs to another data") as e:
                with open_grpc(theirs, hello, codec="none"):
                    pass
            assert str(e.value).count("\n") == 0, what
            assert "steps" not in str(e.value)  # nothing of the run is told
            assert snapshot(b_root) == before, what

        # The owner's --resume is not refused ("no checkpoint step both have").
        summary = split_train(
            split_config,
            [news_data],
            out,
            train_cfg(steps=4, ckpt_every=2),
            opts,
            resume=True,
            progress=False,
        )
        assert summary["steps"] == 4


def make_b_run(root: Path, cfg, owner: str | None) -> Path:
    """A run folder at B with one checkpoint step (2), as a session saves it."""
    from aisyn.model.segments import COMPUTE_PARTY
    from aisyn.split.party import PartyState
    from aisyn.train import checkpoint as ckpt
    from aisyn.train.device import resolve_device

    run = root / "r1"
    (run / "checkpoints").mkdir(parents=True)
    config = {"kind": "split-compute", "run_id": "r1", "model": cfg.to_dict()}
    if owner is not None:
        config[OWNER] = owner
    (run / "config.json").write_text(json.dumps(config))
    part = parse_partition(CUT, cfg)
    state = PartyState(cfg, part, COMPUTE_PARTY, train_cfg(), resolve_device("cpu"))
    ckpt.save(run / "checkpoints", 2, state.tensors(), {"run_id": "r1"})
    return run


def resume_hello(cfg) -> str:
    return proto.encode_json({**fresh_hello(cfg, "r1"), "resume": True, "a_steps": [2]})


def test_a_run_from_before_binding_is_refused_over_the_network(tmp_path, split_config):
    make_b_run(tmp_path, split_config, owner=None)
    party = ComputeParty(split_config, parse_partition(CUT, split_config), tmp_path)
    before = snapshot(tmp_path)
    me = "token-sha256:" + "ab" * 32
    with pytest.raises(HandshakeError, match="no data party bound to it") as e:
        party.negotiate(resume_hello(split_config), me)
    assert f'"{OWNER}": "{me}"' in str(e.value)  # how its operator binds it
    # In-process (--mode local) nothing else can reach B: it goes on.
    reply, session = party.negotiate(resume_hello(split_config), IN_PROCESS)
    assert json.loads(reply)["start_step"] == 2
    assert snapshot(tmp_path) == before
    # Bound by hand as the message says, it is the owner's again.
    config = tmp_path / "r1" / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), OWNER: me}))
    assert (
        json.loads(party.negotiate(resume_hello(split_config), me)[0])["start_step"]
        == 2
    )
    with pytest.raises(HandshakeError, match="belongs to another data party"):
        party.negotiate(resume_hello(split_config), IN_PROCESS)


def test_checkpoints_without_a_config_are_nobodys(tmp_path, split_config):
    run = make_b_run(tmp_path, split_config, owner="x509-sha256:" + "0" * 64)
    (run / "config.json").unlink()
    party = ComputeParty(split_config, parse_partition(CUT, split_config), tmp_path)
    with pytest.raises(HandshakeError, match="no data party bound to it"):
        party.negotiate(resume_hello(split_config), "x509-sha256:" + "0" * 64)


def test_a_link_that_vouches_for_nobody_is_refused(tmp_path, split_config):
    party = ComputeParty(split_config, parse_partition(CUT, split_config), tmp_path)
    with pytest.raises(HandshakeError, match="does not identify the data party"):
        party.negotiate(proto.encode_json(fresh_hello(split_config)), "")


# --- a spawned compute party keeps the data party's identity ----------------------


def test_a_spawned_compute_partys_certificates_are_made_once_per_run(tmp_path):
    from aisyn.split.session import run_dev_certs

    first = run_dev_certs(tmp_path / "certs")
    files = snapshot(tmp_path)
    again = run_dev_certs(tmp_path / "certs")
    assert again == first and snapshot(tmp_path) == files  # the same identity
    first.client_cert.write_text("not a certificate")
    remade = run_dev_certs(tmp_path / "certs")
    assert remade.client_cert.read_bytes() != files["certs/client.pem"]


@pytest.mark.slow
def test_a_spawned_run_resumes_and_evaluates_under_its_binding(
    tmp_path, split_config, news_data
):
    from aisyn.split.client.evaluate import evaluate_split_run

    out = tmp_path / "a"
    opts = SplitOptions(cut=CUT, mode="grpc", spawn_backbone=True)
    for steps, resume in ((2, False), (4, True)):
        summary = split_train(
            split_config,
            [news_data],
            out,
            train_cfg(steps=steps, ckpt_every=2),
            opts,
            resume=resume,
            progress=False,
        )
        assert summary["steps"] == steps
    res = evaluate_split_run(out, data_dir=news_data, device="cpu", max_items=4)
    assert res["test"]["loss"] > 0


def test_an_in_process_run_served_over_the_network_needs_its_operators_word(
    tmp_path, split_config
):
    make_b_run(tmp_path, split_config, owner=IN_PROCESS)  # as --mode local binds
    partition = parse_partition(CUT, split_config)
    me = "x509-sha256:" + "cd" * 32
    strict = ComputeParty(split_config, partition, tmp_path)
    with pytest.raises(HandshakeError, match="made in-process"):
        strict.negotiate(resume_hello(split_config), me)
    assert strict.negotiate(resume_hello(split_config), IN_PROCESS)
    told = ComputeParty(split_config, partition, tmp_path, accept_unbound=True)
    assert (
        json.loads(told.negotiate(resume_hello(split_config), me)[0])["start_step"] == 2
    )
