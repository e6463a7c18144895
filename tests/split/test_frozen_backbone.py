"""``--backbone frozen``: the compute party runs its blocks forward only and
no gradient crosses the cut. A's back blocks and head get the exact gradient
of the model with B's middle frozen; its front gets it through an emulator
of B's middle (exact when the emulator holds every one of B's blocks), or
stays frozen. What crosses is only activations, B's output and A's go/skip;
B's weights stay the base's; what cannot go with it is refused in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import CUT, losses, start_server, train_cfg

from aisyn.link import memory as memory_link
from aisyn.link.errors import HandshakeError
from aisyn.model.segments import parse_partition, segments_of
from aisyn.split import party as party_mod
from aisyn.split.client.train import split_train
from aisyn.split.defence.cut_dp import (
    RECOMMENDED,
    CutDefence,
    Gaussian,
    Recommended,
    undefended_warning,
)
from aisyn.split.defence.emulator import emulated_blocks
from aisyn.split.session import COMPUTE_DIR, SplitOptions
from aisyn.split.transport import LinkSettings
from aisyn.train import checkpoint as ckpt
from aisyn.train.lora import Method
from aisyn.train.models import load_run_model
from aisyn.train.objective import LMObjective
from aisyn.train.pretrain import train


@pytest.fixture(scope="module")
def base(tmp_path_factory, news_data, split_config) -> Path:
    out = tmp_path_factory.mktemp("frozen_base") / "run"
    train(split_config, [news_data], out, train_cfg(steps=4, seed=5), progress=False)
    return out


def frozen(**kw) -> SplitOptions:
    return SplitOptions(cut=CUT, mode="local", backbone="frozen", **kw)


def first_step_gradients(monkeypatch, run) -> dict[str, torch.Tensor]:
    """A's gradients at its first optimizer step of ``run()``."""
    seen: dict[str, torch.Tensor] = {}
    apply = party_mod.PartyState.apply_step

    def spy(self, step, a, b):
        if self.party == "A" and not seen:
            seen.update(
                {n: p.grad.clone() for n, p in self.named if p.grad is not None}
            )
        return apply(self, step, a, b)

    monkeypatch.setattr(party_mod.PartyState, "apply_step", spy)
    run()
    return seen


def reference_gradients(base, data, cfg, *, front_learns: bool) -> dict:
    """The same first step on the whole model, B's middle frozen: autograd
    through the real middle (``front_learns``) or with the front's forward
    outside the graph."""
    model, _ = load_run_model(base)
    partition = parse_partition(CUT, model.config)
    front, back = segments_of(model, partition, "A")
    (middle,) = segments_of(model, partition, "B")
    for name, p in model.named_parameters():
        p.requires_grad_(name in partition.parameter_names(model, "A"))
    objective = LMObjective([data], cfg)
    objective.start(torch.device("cpu"))
    batch = objective.next_step(cfg.batch_size)
    for inputs, targets, mask, pos in batch.micro:
        with torch.set_grad_enabled(front_learns):
            x = front(inputs, mask, pos)
        hidden = back(middle(x, mask), mask, pos)
        batch.loss_of(back.logits, hidden, targets).backward()
    return {
        n: p.grad
        for n, p in model.named_parameters()
        if p.requires_grad and p.grad is not None
    }


def assert_close(got: dict, want: dict, names) -> None:
    for n in names:
        scale = want[n].abs().max().clamp_min(1e-12)
        err = float((got[n] - want[n]).abs().max() / scale)
        assert err < 1e-4, f"{n}: off by {err:.3g} of its largest element"


def test_an_emulator_of_every_block_gives_the_exact_gradient(
    tmp_path, monkeypatch, news_data, split_config, base
):
    cfg = train_cfg(steps=1)
    got = first_step_gradients(
        monkeypatch,
        lambda: split_train(
            split_config, [news_data], tmp_path / "run", cfg,
            frozen(emulator_blocks=2),  # B's middle: h[1:3], both blocks
            init_from=base, progress=False,
        ),
    )  # fmt: skip
    want = reference_gradients(base, news_data, cfg, front_learns=True)
    assert set(got) == set(want)
    assert any(n.startswith("transformer.h.0.") for n in got)  # the front learns
    assert_close(got, want, want)


def test_a_smaller_emulator_estimates_the_front_and_keeps_the_back_exact(
    tmp_path, monkeypatch, news_data, split_config, base
):
    cfg = train_cfg(steps=1)
    got = first_step_gradients(
        monkeypatch,
        lambda: split_train(
            split_config, [news_data], tmp_path / "run", cfg,
            frozen(emulator_blocks=1), init_from=base, progress=False,
        ),
    )  # fmt: skip
    want = reference_gradients(base, news_data, cfg, front_learns=True)
    back = [
        n
        for n in want
        if n.startswith(("transformer.h.3.", "transformer.h.4.", "transformer.ln_f"))
    ]
    assert back
    assert_close(got, want, back)
    front = [n for n in want if n.startswith("transformer.h.0.")]
    g = torch.cat([got[n].flatten() for n in front])
    w = torch.cat([want[n].flatten() for n in front])
    cos = float(torch.nn.functional.cosine_similarity(g, w, dim=0))
    assert 0.5 < cos < 1 - 1e-6, cos  # an estimate, and a good one


def test_a_frozen_front_trains_the_back_and_head_exactly(
    tmp_path, monkeypatch, news_data, split_config, base
):
    cfg = train_cfg(steps=1)
    got = first_step_gradients(
        monkeypatch,
        lambda: split_train(
            split_config, [news_data], tmp_path / "run", cfg,
            frozen(front_via="frozen"), init_from=base, progress=False,
        ),
    )  # fmt: skip
    want = reference_gradients(base, news_data, cfg, front_learns=False)
    assert set(got) == set(want)
    assert not any(n.startswith("transformer.h.0.") for n in got)
    assert_close(got, want, want)


def test_only_activations_cross_and_b_keeps_the_base(
    tmp_path, monkeypatch, news_data, split_config, base
):
    """Every tensor A sends, by tag: activations and a 0 for go; never a
    gradient or a gradient norm. B's checkpoint holds the base's weights."""
    sent: list[tuple[str, object]] = []
    send, send_scalar = memory_link.MemoryLink.send, memory_link.MemoryLink.send_scalar

    def spy(self, tag, t, **kw):
        if self._name == "memory[A]":
            sent.append((tag, None))
        return send(self, tag, t, **kw)

    def spy_scalar(self, tag, value, **kw):
        if self._name == "memory[A]":
            sent.append((tag, value))
        return send_scalar(self, tag, value, **kw)

    monkeypatch.setattr(memory_link.MemoryLink, "send", spy)
    monkeypatch.setattr(memory_link.MemoryLink, "send_scalar", spy_scalar)
    out = tmp_path / "run"
    summary = split_train(
        split_config, [news_data], out, train_cfg(steps=6, ckpt_every=3),
        frozen(), init_from=base, progress=False,
    )  # fmt: skip
    tags = {tag for tag, _ in sent}
    assert tags <= {"ctl", "act", "sqnorm"}, tags
    assert {v for tag, v in sent if tag == "sqnorm"} == {0.0}
    got = losses(out)
    assert len(got) == 6 and got[-1] < got[0], got
    assert summary["bytes_received_per_step"] > 0
    b_run = out / COMPUTE_DIR
    b_files = list(b_run.iterdir())
    (b_folder,) = [p for p in b_files if p.is_dir()]
    b = ckpt.read_tensors(ckpt.latest(b_folder / "checkpoints") / ckpt.MODEL_FILE)
    base_tensors = ckpt.read_tensors(ckpt.model_file(base))
    assert b and all(torch.equal(b[n], base_tensors[n]) for n in b)
    assert json.loads((b_folder / "config.json").read_text())["backbone"] == "frozen"


@pytest.mark.heavy
def test_a_frozen_run_resumes_to_the_uninterrupted_losses(
    tmp_path, news_data, split_config, base
):
    def run(out, steps, resume=False):
        split_train(
            split_config, [news_data], out, train_cfg(steps=steps, ckpt_every=3),
            frozen(), init_from=None if resume else base, resume=resume,
            progress=False,
        )  # fmt: skip

    run(tmp_path / "whole", 6)
    run(tmp_path / "cut", 3)
    run(tmp_path / "cut", 6, resume=True)
    want, got = losses(tmp_path / "whole"), losses(tmp_path / "cut")
    assert len(got) == 6
    assert max(abs(g - w) / abs(w) for g, w in zip(got, want, strict=True)) < 1e-5
    with pytest.raises(
        ValueError, match="trained with --backbone frozen; resume it with that"
    ):
        split_train(
            split_config, [news_data], tmp_path / "cut", train_cfg(steps=8),
            SplitOptions(cut=CUT, mode="local"), init_from=base, resume=True,
            progress=False,
        )  # fmt: skip


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(init_from=None), "needs|give --init-from"),
        (dict(compute_method=Method("lora")), "--compute-method lora has nothing"),
        (
            dict(defence=CutDefence(backward=Gaussian(1.0, 0.1))),
            "leave out --dp-backward",
        ),
    ],
)
def test_what_cannot_go_with_a_frozen_backbone_is_refused_in_one_line(
    tmp_path, news_data, split_config, base, kw, match
):
    args = dict(init_from=base, progress=False) | kw
    with pytest.raises(ValueError, match=match):
        split_train(
            split_config, [news_data], tmp_path / "run", train_cfg(steps=1),
            frozen(), **args,
        )  # fmt: skip
    assert not (tmp_path / "run").exists()


def test_emulated_blocks_are_spread_over_the_middle():
    assert emulated_blocks(range(1, 9), 2) == [1, 8]
    assert emulated_blocks(range(1, 9), 3) == [1, 5, 8]
    assert emulated_blocks(range(1, 9), 1) == [5]
    assert emulated_blocks(range(1, 9), 0) == []
    assert emulated_blocks(range(1, 3), 5) == [1, 2]
    with pytest.raises(ValueError, match="must be >= 0"):
        emulated_blocks(range(1, 3), -1)


@pytest.mark.heavy
def test_over_grpc_a_compute_party_runs_it_as_in_process_and_one_without_a_base_refuses(
    tmp_path, news_data, split_config, base, token_file
):
    settings = LinkSettings("127.0.0.1:0", token_file=str(token_file), insecure=True)
    cfg = train_cfg(steps=3)
    split_train(
        split_config, [news_data], tmp_path / "local", cfg, frozen(),
        init_from=base, progress=False,
    )  # fmt: skip

    def run(server, name):
        peer = LinkSettings(server.address, token_file=str(token_file), insecure=True)
        opts = SplitOptions(cut=CUT, mode="grpc", peer=peer, backbone="frozen")
        split_train(
            split_config, [news_data], tmp_path / name, cfg, opts, init_from=base,
            progress=False,
        )  # fmt: skip

    with start_server(split_config, tmp_path / "b", settings, init_from=base) as s:
        run(s, "grpc")
    assert losses(tmp_path / "grpc") == pytest.approx(losses(tmp_path / "local"))
    with start_server(split_config, tmp_path / "b2", settings) as s:
        with pytest.raises(HandshakeError, match="frozen backbone runs the base"):
            run(s, "refused")


def first_activations(monkeypatch, run) -> torch.Tensor:
    """The first activations A sends B in ``run()``."""
    seen: list[torch.Tensor] = []
    send = memory_link.MemoryLink.send

    def spy(self, tag, t, **kw):
        if self._name == "memory[A]" and tag == "act" and not seen:
            seen.append(t.detach().clone())
        return send(self, tag, t, **kw)

    monkeypatch.setattr(memory_link.MemoryLink, "send", spy)
    run()
    monkeypatch.undo()
    return seen[0]


@pytest.mark.heavy
@pytest.mark.parametrize("backbone", ["frozen", "train"])
def test_a_private_warm_up_moves_the_front_before_anything_crosses(
    tmp_path, monkeypatch, news_data, split_config, base, backbone
):
    """The first activations B sees are no longer the base's on A's text, the
    run starts lower, and none of A's weights is on B's side."""
    opts = dict(cut=CUT, mode="local", backbone=backbone)

    def run(name, warmup):
        return lambda: split_train(
            split_config, [news_data], tmp_path / name, train_cfg(steps=2),
            SplitOptions(**opts, private_warmup=warmup), init_from=base,
            progress=False,
        )  # fmt: skip

    cold = first_activations(monkeypatch, run("cold", 0))
    warm = first_activations(monkeypatch, run("warm", 30))
    assert not torch.allclose(cold, warm, atol=1e-3)
    record = json.loads((tmp_path / "warm" / "warmup.json").read_text())
    assert record["steps"] == 30 and record["loss_last"] < record["loss_first"]
    assert losses(tmp_path / "warm")[0] < losses(tmp_path / "cold")[0]
    a = ckpt.read_tensors(
        ckpt.latest(tmp_path / "warm" / "checkpoints") / ckpt.MODEL_FILE
    )
    for f in (tmp_path / "warm" / COMPUTE_DIR).rglob("*.safetensors"):
        b = ckpt.read_tensors(f)
        assert not set(a) & set(b), f
        assert not any(
            t.shape == u.shape and torch.equal(t, u)
            for t in b.values()
            for u in a.values()
        )


def test_a_warm_up_is_refused_where_it_cannot_run(
    tmp_path, news_data, split_config, base
):
    for kw, match in [
        (dict(init_from=None), "--private-warmup trains through an emulator"),
        (
            dict(init_from=base, method=Method("lora")),
            "with --method lora leave it out",
        ),
    ]:
        with pytest.raises(ValueError, match=match):
            split_train(
                split_config, [news_data], tmp_path / "run", train_cfg(steps=1),
                SplitOptions(cut=CUT, mode="local", private_warmup=3), progress=False,
                **kw,
            )  # fmt: skip
        assert not (tmp_path / "run").exists()


def test_the_command_line_runs_it_and_says_which_channel_is_open(
    tmp_path, news_data, split_config, base, caplog, monkeypatch
):
    import aisyn.split.defence.attach
    from aisyn.cli import main

    monkeypatch.setattr(aisyn.split.defence.attach, "CALIBRATION_ROWS", 16)  # fast

    model = tmp_path / "model.json"
    model.write_text(json.dumps(split_config.to_dict()))
    argv = ["split", "train", "--model", str(model), "--data", str(news_data)]
    argv += ["--out", str(tmp_path / "run"), "--cut", CUT, "--quiet", "--steps", "2"]
    argv += ["--batch-size", "4", "--micro-batch-size", "2", "--seed", "1234567"]
    argv += ["--init-from", str(base), "--backbone", "frozen", "--private-warmup", "2"]
    assert main(argv) in (0, None)
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert not any("no cut defence" in w for w in warnings)
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    # the default defence: the recommended noise on the activations alone, as
    # no gradient crosses to noise
    defence = CutDefence.from_dict(config["cut_defence"])
    assert defence.forward.noise == RECOMMENDED.forward and defence.forward.clip > 0
    assert defence.backward is None
    assert Recommended(gradient=False).matches(defence)
    assert not Recommended().matches(defence)
    # accounted as what crosses: the activations alone (no gradient term)
    privacy = json.loads((tmp_path / "run" / "privacy.json").read_text())
    assert privacy["dp_epsilon"] is not None and privacy["dp_epsilon"] > 0
    # and --defence none says which channel it leaves open
    line = undefended_warning(frozen_backbone=True)
    assert line.startswith("--defence none") and "no gradient crosses" in line
    assert config["split"]["backbone"] == "frozen"
    assert config["split"]["private_warmup"] == 2
    assert (tmp_path / "run" / "warmup.json").is_file()
