"""Federated settings: shipped scenarios load, bad values are refused clearly."""

from __future__ import annotations

import math
import re

import pytest

from aisyn.fl.settings import FLSettings, load_settings
from aisyn.flagfile import shipped_configs
from aisyn.train.config import TrainConfig


def test_shipped_scenarios_load_and_flags_override():
    assert {"scenario3", "scenario4"} <= set(shipped_configs())
    s3 = load_settings("scenario3")
    s4 = load_settings("scenario4", rounds=4, strategy="fedprox")
    assert s3.rounds <= 10 and s3.min_clients == 2
    assert s4.rounds == 4 and s4.strategy == "fedprox"
    assert FLSettings.from_run_config(s3.to_run_config()) == s3


def test_settings_hold_each_clients_train_config():
    s = FLSettings.from_dict(
        {"rounds": 3, "local-steps": 4, "lr": 0.01, "micro-batch-size": 0}
    )
    assert isinstance(s.train, TrainConfig)
    assert (s.train.steps, s.train.lr, s.train.warmup_steps) == (12, 0.01, 10)
    assert s.train.micro_batch_size is None and s.train.min_lr is None  # defaults
    assert "min-lr" not in s.to_run_config()  # TOML has no None
    assert FLSettings.from_run_config(s.to_run_config()) == s
    t = FLSettings.from_dict({"min_lr": 1e-5, "micro_batch_size": 4, "rounds": 2})
    assert (t.train.min_lr, t.train.micro_batch_size, t.train.steps) == (1e-5, 4, 100)
    assert FLSettings.from_run_config(t.to_run_config()) == t
    with pytest.raises(ValueError, match="min-lr must be >= 0"):
        FLSettings.from_dict({"min-lr": -1.0})


def test_schedule_continues_across_rounds_or_restarts():
    cont = FLSettings.from_dict(
        dict(rounds=4, local_steps=10, warmup=0, lr=1.0, schedule="continue")
    )
    rest = FLSettings.from_dict(
        dict(rounds=4, local_steps=10, warmup=0, lr=1.0, schedule="restart")
    )
    # continue: round 3 picks up the one cosine where round 2 left it
    assert cont.lr_at(3, 20) < cont.lr_at(2, 19) < cont.lr_at(1, 0)
    # restart: every round starts again at the peak
    assert rest.lr_at(3, 20) == rest.lr_at(1, 0) == 1.0


@pytest.mark.parametrize(
    "text, message",
    [
        ('rounds = "ten"', "rounds must be a int"),
        ("strategy = 'fedsgd'", "unknown strategy"),
        ("lr = -1.0", "lr must be positive"),
        ("colour = 'red'", "unknown federated settings"),
        ("rounds = [", "not valid TOML"),
    ],
)
def test_bad_settings_file_gives_a_clear_error(tmp_path, text, message):
    path = tmp_path / "bad.toml"
    path.write_text(f"[federated]\n{text}\n")
    with pytest.raises(ValueError, match=message):
        load_settings(path)


@pytest.mark.parametrize(
    "argv",
    [
        ["fl", "simulate"],
        ["fl", "server"],
        ["fl", "client"],
        ["fl", "partition"],
        ["experiment", "compare"],
        ["prepare-sft"],
        ["finetune"],
    ],
)
def test_every_fl_and_experiment_command_has_help(argv, capsys):
    from aisyn.cli import build_parser

    with pytest.raises(SystemExit) as done:
        build_parser().parse_args([*argv, "--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert "usage:" in out and len(out) > 300


@pytest.mark.parametrize(
    ("given", "says"),
    [
        ({"proximal_mu": 0.1}, "--proximal-mu is fedprox's; strategy fedavg"),
        ({"strategy": "fedprox", "eta": 0.01}, "--eta is fedadam's; strategy fedprox"),
        (
            {"strategy": "fedprox", "server_lr": 0.5},
            "--server-lr is fedavgm and scaffold's; strategy fedprox",
        ),
        (
            {"strategy": "scaffold", "server_momentum": 0.5},
            "--server-momentum is fedavgm's",
        ),
        ({"trim_fraction": 0.3}, "--trim-fraction is trimmed-mean's"),
        ({"assumed_attackers": 2}, "--assumed-attackers is krum and multikrum"),
    ],
)
def test_a_setting_the_strategy_does_not_take_is_refused_in_one_line(given, says):
    with pytest.raises(ValueError, match=re.escape(says)) as e:
        load_settings(None, min_clients=2, **given)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    ("value", "says"),
    [
        (math.nan, "server-lr must be a finite number"),
        (math.inf, "server-lr must be a finite number"),
        (0.0, "server-lr must be positive"),
        (-2.0, "server-lr must be positive"),
        ("2", "server-lr must be a float"),
    ],
)
def test_scaffold_refuses_a_global_step_that_is_no_positive_finite_number(value, says):
    with pytest.raises(ValueError, match=says) as e:
        load_settings(None, strategy="scaffold", server_lr=value, min_clients=2)
    assert "\n" not in str(e.value)


def test_a_setting_its_strategy_takes_passes():
    assert load_settings(None, strategy="fedprox", proximal_mu=0.1).proximal_mu == 0.1
    assert load_settings(None, strategy="scaffold", server_lr=2.0).server_lr == 2.0
    s = load_settings(
        None, aggregation="trimmed-mean", trim_fraction=0.3, min_clients=4
    )
    assert s.trim_fraction == 0.3
    # a config file's own keys are its business: only what is given is judged
    assert load_settings("scenario4", strategy="fedprox").strategy == "fedprox"
