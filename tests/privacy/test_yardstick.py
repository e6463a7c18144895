"""The yardstick's arithmetic: the share of the gain a defence keeps, VFLAIR's
DCS, the goal, the choice of the best trade, the summary line scripts read,
and which configuration is ``aisyn split train``'s default."""

from __future__ import annotations

import json
import re

import pytest

from aisyn.privacy.frontier import ATTACKS_EDITION
from aisyn.privacy.yardstick import (
    UNDEFENDED,
    Config,
    best_trade,
    dcs,
    is_default,
    kept,
    meets_goal,
    summarise,
    summary_line,
    worst,
)
from aisyn.split.session import SplitOptions

LINE = re.compile(
    r"default defence: attacks max \d+\.\d % \(guess \d+\.\d %\), inverter \d+\.\d %, "
    r"gain kept (\d+|--) % \(loss\) / (\d+|--) % \(cloze\), step x\d\.\d\d"
)


def test_kept_is_the_share_of_the_undefended_gain_either_way_round():
    assert kept(5.0, 4.5, 4.0, higher_better=False) == pytest.approx(0.5)
    assert kept(0.2, 0.5, 0.6, higher_better=True) == pytest.approx(0.75)
    assert kept(5.0, 5.2, 4.0, higher_better=False) == pytest.approx(-0.2)
    assert kept(5.0, 4.0, 5.0, higher_better=False) is None  # nothing to keep


def test_dcs_is_one_at_the_ideal_and_falls_with_distance():
    assert dcs(0.0, 0.6, 0.6) == 1.0
    assert dcs(0.5, 0.6, 0.6) == pytest.approx(1 / (1 + (0.5 * 0.25) ** 0.5))
    assert dcs(0.9, 0.6, 0.6) < dcs(0.1, 0.6, 0.6) < dcs(0.1, 0.6, 0.6 + 1e-9) + 1e-6


def attacks(fwd: float, bwd: float | None, inverter: float | None = None):
    rows = [
        {
            "direction": "forward",
            "frequent_token": 0.1,
            "recovery_learned": fwd,
            **({} if inverter is None else {"recovery_sequence inverter": inverter}),
        },
        {"direction": "backward", "frequent_token": 0.12, "recovery_learned": bwd},
    ]
    return rows


def test_worst_splits_the_trained_inverters_from_the_rest_and_skips_nothing_crossed():
    assert worst(attacks(0.3, 0.9, 0.5), trained=False) == (0.9, 0.12)
    assert worst(attacks(0.3, 0.9, 0.5), trained=True) == (0.5, 0.12)
    assert worst(attacks(0.3, None), trained=False) == (0.3, 0.12)
    assert worst(attacks(0.3, None), trained=True) == (None, 0.12)


def run(seed, loss, cloze, fwd, bwd, inverter, step):
    return {
        "seed": seed,
        "loss": loss,
        "cloze": cloze,
        "attacks": attacks(fwd, bwd, inverter),
        "step_time_s": step,
        "dp_epsilon": None,
        "bytes_per_step": 1,
    }


def test_summarise_keeps_per_seed_against_the_same_seeds_undefended_run():
    frozen = Config("frozen", backbone="frozen")
    results = {
        UNDEFENDED.name: [
            run(1, 4.0, 0.6, 0.7, 0.96, 0.9, 1.0),
            run(2, 4.2, 0.5, 0.7, 0.96, 0.9, 1.0),
        ],
        frozen.name: [
            run(1, 4.2, 0.5, 0.11, None, 0.14, 1.1),
            run(2, 4.4, 0.45, 0.13, None, 0.16, 1.1),
        ],
    }
    base = {"loss": 5.0, "cloze": 0.2}
    rows = {r["config"]: r for r in summarise(results, [UNDEFENDED, frozen], base)}
    f = rows["frozen"]
    # seed 1: 0.8/1.0 of the loss gain, 0.3/0.4 of the cloze gain;
    # seed 2: 0.6/0.8 and 0.25/0.3
    assert f["kept_loss"] == pytest.approx((0.8 + 0.75) / 2)
    assert f["kept_cloze"] == pytest.approx((0.75 + 0.25 / 0.3) / 2)
    assert f["kept_loss_spread"] == pytest.approx(0.05)
    assert f["attack"] == pytest.approx(0.12) and f["inverter"] == pytest.approx(0.15)
    assert f["step_ratio"] == pytest.approx(1.1)
    assert f["meets_goal"]  # 12 % <= 12 + 2, 15 % <= 12 + 5, kept >= 70 %
    assert not rows["undefended"]["meets_goal"]
    assert best_trade(list(rows.values()))["config"] == "frozen"
    line = summary_line(f)
    assert LINE.fullmatch(line), line
    assert line == (
        "default defence: attacks max 12.0 % (guess 12.0 %), inverter 15.0 %, "
        "gain kept 77 % (loss) / 79 % (cloze), step x1.10"
    )


def test_the_goal_fails_on_each_of_its_terms():
    ok = dict(
        attack=0.13,
        guess=0.12,
        inverter=0.16,
        kept_loss=0.8,
        kept_cloze=0.9,
        step_ratio=1.1,
    )
    assert meets_goal(ok)
    for key, bad in [
        ("attack", 0.15),
        ("inverter", 0.18),
        ("kept_loss", 0.69),
        ("kept_cloze", None),
        ("step_ratio", 1.25),
    ]:
        assert not meets_goal({**ok, key: bad}), key


def test_with_none_passing_the_best_trade_is_the_highest_dcs():
    rows = [
        {"config": "a", "meets_goal": False, "dcs": 0.6},
        {"config": "b", "meets_goal": False, "dcs": 0.8},
    ]
    assert best_trade(rows)["config"] == "b"


def test_the_default_is_what_split_train_runs_without_flags():
    from aisyn.split.defence.cut_dp import Recommended, defence_from_flags

    # split train with no flag: its options' defaults, the recommended noise
    assert isinstance(defence_from_flags(), Recommended)
    assert is_default(Config("x", forward=0.1, backward=0.3, **{
        k: getattr(SplitOptions(), k)
        for k in ("backbone", "front_via", "emulator_blocks", "private_warmup")
    }))  # fmt: skip
    assert not is_default(UNDEFENDED)
    assert not is_default(Config("y", forward=0.1))
    assert not is_default(Config("z", forward=0.1, backward=0.3, private_warmup=2))
    assert Config("r", forward=0.1, backward=0.3).flags == "--defence recommended"
    assert Config("w", backbone="frozen", private_warmup=5).flags == (
        "--backbone frozen --private-warmup 5 --defence none"
    )
    # with a frozen backbone the default noises the activations alone
    assert Config("f", backbone="frozen", forward=0.1).flags == (
        "--backbone frozen --defence recommended"
    )
    assert UNDEFENDED.flags == "--defence none"
    bottleneck = Config("b", backward=0.3, bottleneck_floor=16, bottleneck_beta=0.1)
    assert bottleneck.flags == "--bottleneck-floor 16 --bottleneck-beta 0.1"
    assert not is_default(bottleneck)


@pytest.mark.heavy
def test_measure_runs_scores_and_attacks_each_configuration_and_reuses_a_scored_run(
    tmp_path, base, news_data, news_sft, reviews_data, tokenizer, tiny_inverter
):
    """Real split runs of two configurations on the tiny base: scores on A's
    domain, the attacks (a frozen backbone's backward ones with nothing to
    read, a warmed-up run attacked only late), and a second call reusing the
    trained run and its attacks (unless the attacks' edition changed)."""
    import torch

    from aisyn.data.sft import SFTData
    from aisyn.data.shards import TokenShards
    from aisyn.eval.cloze import encode_items
    from aisyn.privacy.yardstick import Inputs, measure
    from aisyn.split.defence.calibration import calibrate
    from aisyn.train.config import TrainConfig
    from aisyn.train.models import load_run_model

    base_model, _ = load_run_model(base)
    rows = TokenShards.open(news_data, "test").batch(torch.arange(2))
    public = TokenShards.open(reviews_data, "train").batch(torch.arange(16))
    items = SFTData.open(news_sft, "train").test_items()[:4]
    inputs = Inputs(
        mcfg=base_model.config,
        base=base,
        data=news_data,
        sft=news_sft,
        cloze=encode_items(items, tokenizer, 32, "prompt"),
        pad_id=tokenizer.pad_id,
        rows=rows,
        public_rows=public,
        cut="u:1,1",
        eval_batches=1,
        attack_steps=2,
        inverter=tiny_inverter,
    )
    clips = calibrate(base_model, public, "u:1,1", 4)
    cfg = TrainConfig(steps=2, batch_size=4, lr=1e-3, warmup_steps=1, device="cpu")
    warm = Config("frozen + warm-up", backbone="frozen", private_warmup=2)
    got = {
        c.name: measure(c, 7, inputs, clips, cfg, tmp_path / c.name)
        for c in (UNDEFENDED, warm)
    }
    for r in got.values():
        assert r["loss"] > 0 and r["text_loss"] > 0 and r["step_time_s"] > 0
        assert 0 <= r["cloze"] <= 1
    undefended = {
        (a["A_weights"], a["direction"]) for a in got["undefended"]["attacks"]
    }
    assert ("base (early)", "backward") in undefended
    frozen = got["frozen + warm-up"]["attacks"]
    assert {a["A_weights"] for a in frozen} == {"trained (late)"}
    back = [a for a in frozen if a["direction"] == "backward"]
    assert back and all(
        a["recovery_white-box"] is None and a["best_attack"] == "base head"
        for a in back
    )
    scored = tmp_path / "undefended" / "scores.json"
    attacked = tmp_path / "undefended" / "attacks.json"
    before = scored.stat().st_mtime_ns, attacked.stat().st_mtime_ns
    again = measure(UNDEFENDED, 7, inputs, clips, cfg, tmp_path / "undefended")
    assert (scored.stat().st_mtime_ns, attacked.stat().st_mtime_ns) == before
    assert again == got["undefended"]  # trained, scored and attacked once
    # attacks of another edition (or other settings) run again
    saved = json.loads(attacked.read_text())
    saved["key"]["edition"] -= 1
    attacked.write_text(json.dumps(saved))
    measure(UNDEFENDED, 7, inputs, clips, cfg, tmp_path / "undefended")
    assert json.loads(attacked.read_text())["key"]["edition"] == ATTACKS_EDITION
    assert scored.stat().st_mtime_ns == before[0]
