"""Split fine-tuning (``aisyn split train --sft``) computes the steps of
standalone ``aisyn finetune``: from the same base, on the same batches, every
step's loss within 1e-5 relative and both halves' final weights equal to the
standalone model's, in-process (lockstep and pipelined) and over gRPC.

The data party sends nothing but the control and the activations and their
gradients: no labels, answer positions or lengths; the compute party handles a
sequence length that changes from step to step (batches are padded to their
longest item).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from conftest import CUT, losses, start_server, train_cfg

from aisyn.split.client.merge import merge
from aisyn.split.client.train import split_train
from aisyn.split.session import COMPUTE_DIR, SplitOptions
from aisyn.split.transport import LinkSettings
from aisyn.train import checkpoint as ckpt
from aisyn.train.finetune import finetune
from aisyn.train.lora import Method
from aisyn.train.run import RunDir, read_metrics

REL = 1e-5
STEPS = 12


@pytest.fixture(scope="module")
def base(ft_base) -> Path:
    return ft_base


@pytest.fixture(scope="module")
def sft_dir(ft_sft_dir) -> Path:
    return ft_sft_dir


def ft_cfg():
    return train_cfg(steps=STEPS, lr=1e-3, warmup_steps=2)


@pytest.fixture(scope="module")
def standalone(tmp_path_factory, base, sft_dir) -> Path:
    """``aisyn finetune`` of the base on the SFT folder: the reference."""
    out = tmp_path_factory.mktemp("ft_standalone") / "run"
    finetune(base, [sft_dir], out, ft_cfg(), progress=False)
    return out


def final_weights(run: Path) -> dict[str, torch.Tensor]:
    return ckpt.read_tensors(ckpt.model_file(run))


def assert_same_steps(
    split_a: Path, split_b: Path, standalone: Path, base: Path
) -> None:
    """Per-step losses and the final weights of both halves."""
    want, got = losses(standalone), losses(split_a)
    assert len(got) == len(want) == STEPS
    worst = max(abs(g - w) / abs(w) for g, w in zip(got, want, strict=True))
    assert worst <= REL, f"max relative loss difference {worst:.3g} > {REL}"
    reference = final_weights(standalone)
    a, b = final_weights(split_a), final_weights(split_b)
    assert not set(a) & set(b)
    merged = {**a, **b}
    # the standalone checkpoint may also hold the tied head under its own name
    assert set(merged) <= set(reference)
    assert set(reference) - set(merged) <= {"lm_head.weight"}
    for name, w in merged.items():
        diff = float((w - reference[name]).abs().max())
        # Within 1e-5 of the tensor's largest weight. A key bias gets no
        # gradient in exact arithmetic (softmax ignores a shift shared by all
        # keys), so in both runs it is rounding noise that AdamW scales up
        # (|w| ~ 1e-6): it is held to 1e-5 absolute instead.
        scale = 1.0 if name.endswith("attn.k_proj.bias") else reference[name]
        scale = float(torch.as_tensor(scale).abs().max())
        assert diff <= REL * scale, f"{name}: max |difference| {diff:.3g}"
    # the runs really trained, and from the base: the middle moved away from it
    start = final_weights(base)
    assert max(float((w - start[n]).abs().max()) for n, w in b.items()) > 1e-4


def b_run(root: Path) -> Path:
    (run,) = [p for p in root.iterdir() if (p / "checkpoints").is_dir()]
    return run


@pytest.mark.heavy
@pytest.mark.parametrize("window", [0, 2], ids=["lockstep", "pipelined"])
def test_in_process_matches_standalone_finetuning(
    tmp_path, ft_config, base, sft_dir, standalone, window, monkeypatch
):
    from aisyn.link.memory import MemoryLink

    # Prepare: record every tensor A sends and every control B receives
    sent: list[tuple[str, torch.dtype, tuple[int, ...]]] = []
    controls: list[list[int]] = []
    original = MemoryLink.send

    def spy(self, tag, tensor, **kw):
        if self.peer.role == "B":  # the data party's end
            sent.append((tag, tensor.dtype, tuple(tensor.shape)))
            if tag == "ctl":
                controls.append(tensor.tolist())
        return original(self, tag, tensor, **kw)

    monkeypatch.setattr(MemoryLink, "send", spy)
    out = tmp_path / "split"
    # Execute
    summary = split_train(
        ft_config,
        [sft_dir],
        out,
        ft_cfg(),
        SplitOptions(cut=CUT, mode="local", window=window),
        sft=True,
        init_from=base,
        progress=False,
    )
    # Assert: the same steps as aisyn finetune
    assert_same_steps(out, b_run(out / COMPUTE_DIR), standalone, base)
    assert summary["final_loss"] == pytest.approx(losses(standalone)[-1], rel=REL)
    config = RunDir(out).read_config()
    assert config["kind"] == "split" and config["objective"] == "sft"
    # what crossed: controls, activations and their gradients; nothing else
    assert {tag for tag, _, _ in sent} == {"ctl", "act", "gout"}
    train_rounds = [c for c in controls if c[0] == 1]  # TRAIN
    lengths = [c[4] for c in train_rounds]
    assert len(set(lengths)) > 1, "every batch padded to one length: a weak test"
    assert max(lengths) <= ft_config.seq_len
    shapes = {s for tag, _, s in sent if tag in ("act", "gout")}
    assert shapes == {(2, t, ft_config.hidden_size) for t in lengths}
    assert all(d == torch.float32 for tag, d, _ in sent if tag in ("act", "gout"))


@pytest.mark.heavy
def test_grpc_matches_standalone_finetuning(
    tmp_path, ft_config, base, sft_dir, standalone, token_file
):
    # Prepare: a real gRPC compute party (plaintext on loopback) given the base
    settings = LinkSettings("127.0.0.1:0", token_file=str(token_file), insecure=True)
    with start_server(ft_config, tmp_path / "b", settings, init_from=base) as server:
        peer = LinkSettings(server.address, token_file=str(token_file), insecure=True)
        # Execute: pipelined over the wire
        split_train(
            ft_config,
            [sft_dir],
            tmp_path / "a",
            ft_cfg(),
            SplitOptions(cut=CUT, mode="grpc", window=2, peer=peer),
            sft=True,
            init_from=base,
            progress=False,
        )
    # Assert
    assert_same_steps(tmp_path / "a", b_run(tmp_path / "b"), standalone, base)


@pytest.mark.heavy
def test_resume_continues_split_finetuning(tmp_path, ft_config, base, sft_dir):
    """Cut back to its step-6 checkpoints and resumed, a split fine-tuning run
    repeats steps 7-12 exactly (the SFT data position is in the checkpoint)."""
    # Prepare: 12 steps with checkpoint pairs at 6 and 12
    out = tmp_path / "split"
    cfg = train_cfg(steps=STEPS, lr=1e-3, warmup_steps=2, ckpt_every=6)
    opts = SplitOptions(cut=CUT, mode="local")
    run = dict(sft=True, init_from=base, progress=False)
    split_train(ft_config, [sft_dir], out, cfg, opts, **run)
    whole = losses(out)
    for checkpoints in (out / "checkpoints", b_run(out / COMPUTE_DIR) / "checkpoints"):
        shutil.rmtree(ckpt.step_folder(checkpoints, STEPS))
        (checkpoints / ckpt.LATEST).write_text(ckpt.step_folder(checkpoints, 6).name)
    # Execute
    split_train(ft_config, [sft_dir], out, cfg, opts, resume=True, **run)
    # Assert
    assert len(whole) == STEPS
    assert losses(out) == pytest.approx(whole, rel=REL)


def test_validation_through_the_link_matches_standalone(
    tmp_path, ft_config, base, sft_dir
):
    """--eval-every: the SFT validation loss (answer tokens of the valid
    items) is computed through the link and equals aisyn finetune's."""
    cfg = train_cfg(steps=4, eval_every=2, lr=1e-3, warmup_steps=1)
    finetune(base, [sft_dir], tmp_path / "ref", cfg, progress=False)
    split_train(
        ft_config,
        [sft_dir],
        tmp_path / "split",
        cfg,
        SplitOptions(cut=CUT, mode="local"),
        sft=True,
        init_from=base,
        progress=False,
    )

    def val_losses(run: Path) -> list[float]:
        return [
            r["val_loss"]
            for r in read_metrics(run / "metrics.jsonl")
            if "val_loss" in r
        ]

    want, got = val_losses(tmp_path / "ref"), val_losses(tmp_path / "split")
    assert len(got) == len(want) == 2
    assert got == pytest.approx(want, rel=REL)


# --- LoRA on either party's blocks -------------------------------------------

LORA = Method("lora", rank=4, alpha=8.0)


def lora_split(out, ft_config, base, sft_dir, cfg=None, *, a=LORA, b=LORA, **kw):
    return split_train(
        ft_config,
        [sft_dir],
        out,
        cfg or ft_cfg(),
        SplitOptions(cut=CUT, mode="local", window=2),
        sft=True,
        init_from=base,
        progress=False,
        method=a,
        compute_method=b,
        **kw,
    )


@pytest.mark.heavy
def test_lora_on_both_parties_matches_standalone_lora(
    tmp_path, ft_config, base, sft_dir
):
    """Each party adapts its own blocks, drawing every adapter as the unsplit
    model does (B from seeds A gives it): the steps are standalone LoRA
    fine-tuning's, and the merged halves are its merged model."""
    finetune(base, [sft_dir], tmp_path / "ref", ft_cfg(), LORA, progress=False)
    out = tmp_path / "split"
    lora_split(out, ft_config, base, sft_dir)
    want, got = losses(tmp_path / "ref"), losses(out)
    assert len(got) == STEPS
    assert max(abs(g - w) / abs(w) for g, w in zip(got, want, strict=True)) <= REL
    merge(out, b_run(out / COMPUTE_DIR), tmp_path / "merged")
    reference, merged = (
        final_weights(tmp_path / "ref"),
        final_weights(tmp_path / "merged"),
    )
    start = final_weights(base)
    for name, w in merged.items():
        torch.testing.assert_close(w, reference[name], rtol=0, atol=1e-5, msg=name)
    # the adapters moved the adapted weights away from the base, and only those
    moved = {n for n, w in merged.items() if not torch.equal(w, start[n])}
    assert moved and all(n.endswith("_proj.weight") or ".c_fc." in n for n in moved)
    # a generate session puts base + adapters back on both sides: the same
    # tokens and logits as the merged model
    from test_split_generate import SAMPLINGS, assert_same, split, unsplit

    want = unsplit(tmp_path / "merged", SAMPLINGS["greedy"])
    assert_same(split(out, SAMPLINGS["greedy"], mode="local"), want)


@pytest.mark.heavy
def test_a_compute_party_with_lora_keeps_its_base_and_saves_adapters_only(
    tmp_path, ft_config, base, sft_dir
):
    """A trains its blocks in full, B trains adapters on its frozen blocks: B's
    checkpoints hold the adapters (and their moments) alone, a fraction of its
    blocks' size, and resuming from step 6 repeats steps 7-12 exactly."""
    from aisyn.train.lora import lora_parameter_names

    base_bytes = ckpt.model_file(base).read_bytes()
    out = tmp_path / "split"
    cfg = train_cfg(steps=STEPS, lr=1e-3, warmup_steps=2, ckpt_every=6)
    lora_split(out, ft_config, base, sft_dir, cfg, a=Method())
    whole = losses(out)
    assert whole[-1] < whole[0]
    b_folder = b_run(out / COMPUTE_DIR)
    b_weights = final_weights(b_folder)
    assert b_weights and all(".lora_" in n for n in b_weights)
    from aisyn.model.families import build_model
    from aisyn.model.segments import parse_partition

    meta = build_model(ft_config, device="meta")
    b_paths = parse_partition(CUT, ft_config).module_paths("B")
    assert sorted(b_weights) == sorted(lora_parameter_names(meta, LORA, b_paths))
    assert RunDir(b_folder).read_config()["lora"] == {"rank": 4, "alpha": 8.0}
    a_weights = final_weights(out)
    assert not any(".lora_" in n for n in a_weights)
    assert ckpt.model_file(base).read_bytes() == base_bytes  # the base untouched
    # resume from step 6: the same steps again
    for checkpoints in (out / "checkpoints", b_folder / "checkpoints"):
        shutil.rmtree(ckpt.step_folder(checkpoints, STEPS))
        (checkpoints / ckpt.LATEST).write_text(ckpt.step_folder(checkpoints, 6).name)
    lora_split(out, ft_config, base, sft_dir, cfg, a=Method(), resume=True)
    assert losses(out) == pytest.approx(whole, rel=REL)
    # and the merged model is the base plus the adapters' deltas on B's blocks
    merge(out, b_folder, tmp_path / "merged")
    merged, start = final_weights(tmp_path / "merged"), final_weights(base)
    mid = "transformer.h.2.attn.q_proj.weight"  # a block of B's (cut u:1,1)
    assert not torch.equal(merged[mid], start[mid])


def test_lora_without_a_base_is_refused(tmp_path, ft_config, news_data):
    with pytest.raises(ValueError, match="LoRA trains adapters on a base model"):
        split_train(
            ft_config,
            [news_data],
            tmp_path / "x",
            train_cfg(steps=1),
            SplitOptions(cut=CUT, mode="local"),
            progress=False,
            compute_method=LORA,
        )
    assert not (tmp_path / "x").exists()


@pytest.mark.heavy
def test_lora_over_grpc_against_a_served_base(
    tmp_path, ft_config, base, sft_dir, token_file
):
    """A compute party serving the base (aisyn split serve --init-from) takes
    LoRA from the hello: the same steps as in-process."""
    lora_split(tmp_path / "local", ft_config, base, sft_dir)
    settings = LinkSettings("127.0.0.1:0", token_file=str(token_file), insecure=True)
    with start_server(ft_config, tmp_path / "b", settings, init_from=base) as server:
        peer = LinkSettings(server.address, token_file=str(token_file), insecure=True)
        split_train(
            ft_config,
            [sft_dir],
            tmp_path / "a",
            ft_cfg(),
            SplitOptions(cut=CUT, mode="grpc", window=2, peer=peer),
            sft=True,
            init_from=base,
            progress=False,
            method=LORA,
            compute_method=LORA,
        )
    assert losses(tmp_path / "a") == pytest.approx(losses(tmp_path / "local"), rel=REL)
    assert all(".lora_" in n for n in final_weights(b_run(tmp_path / "b")))


@pytest.mark.parametrize(
    ("lora", "message"),
    [
        ({"rank": 0, "alpha": 8.0, "seeds": {}}, "lora rank must be in 1..4096"),
        ({"rank": 4, "alpha": float("nan"), "seeds": {}}, "lora alpha must be"),
        ({"rank": 4, "alpha": 8.0, "seeds": {"x": 1}}, "init_seeds are not this"),
        ({"rank": 4, "alpha": 8.0}, "lora must be an object of rank, alpha, seeds"),
    ],
)
def test_a_bad_lora_hello_is_refused(tmp_path, ft_config, base, lora, message):
    from aisyn.link.errors import HandshakeError
    from aisyn.link.memory import IN_PROCESS
    from aisyn.model.segments import parse_partition
    from aisyn.split import protocol as proto
    from aisyn.split.backbone.compute_party import ComputeParty

    cfg = ft_config
    party = ComputeParty(cfg, parse_partition(CUT, cfg), tmp_path, init_from=base)
    hello = proto.hello(
        purpose="train",
        run_id="run-1",
        model=cfg.to_dict(),
        partition=parse_partition(CUT, cfg).to_dict(),
        train=ft_cfg(),
        lora=lora,
        init=party.base.fingerprint,
    )
    with pytest.raises(HandshakeError, match=message):
        party.negotiate(proto.encode_json(hello), IN_PROCESS)
    assert list(tmp_path.iterdir()) == []  # nothing written


@pytest.mark.heavy
def test_split_fine_tuning_runs_the_recommended_defence_calibrated_at_the_base(
    tmp_path, ft_config, base, sft_dir, monkeypatch
):
    """The default defence of `split train --sft`: the bounds are measured on
    the built-in public text through the base the run starts from (what the
    privacy yardstick measures for fine-tuning, docs/privacy.md), and the run
    is accounted."""
    import json

    import aisyn.split.defence.attach
    from aisyn.data.sft import SFTData
    from aisyn.data.tokenizer import open_tokenizer
    from aisyn.split.defence import cut_dp as dp
    from aisyn.split.defence.calibration import calibrate, public_rows
    from aisyn.train.models import load_run_model

    monkeypatch.setattr(aisyn.split.defence.attach, "CALIBRATION_ROWS", 16)  # fast
    out = tmp_path / "run"
    summary = split_train(
        ft_config,
        [sft_dir],
        out,
        ft_cfg(),
        SplitOptions(cut=CUT, mode="local"),
        sft=True,
        init_from=base,
        progress=False,
        defence=dp.Recommended(implied=True),
    )
    used = dp.CutDefence.from_dict(RunDir(out).read_config()["cut_defence"])
    assert dp.Recommended().matches(used)
    meta = json.loads((sft_dir / "manifest.json").read_text())["tokenizer"]
    model, _ = load_run_model(base)
    seq_len = SFTData.open(sft_dir, "train").seq_len
    rows = public_rows(open_tokenizer(sft_dir / meta["file"], meta), seq_len, 16)
    batch = ft_cfg().batch_size
    clips = calibrate(model.eval().requires_grad_(False), rows, CUT, batch)
    assert (used.forward.clip, used.backward.clip) == pytest.approx(
        (clips.forward, clips.backward), rel=1e-5
    )
    eps = summary["privacy"]["dp_epsilon"]
    assert eps is not None and 0 < eps < float("inf")
