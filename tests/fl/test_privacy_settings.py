"""Settings of secure aggregation and client DP: flags, TOML, and refusals."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from aisyn.fl.settings import FLSettings, load_settings


def test_privacy_settings_load_from_toml_and_turn_the_norm_bound_off(tmp_path):
    path = tmp_path / "private.toml"
    path.write_text(
        "[federated]\n"
        "secure-aggregation = true\n"
        "secagg-threshold = 3\n"
        "min-clients = 4\n"
        'dp = "client"\n'
        "dp-noise-multiplier = 0.8\n"
        "dp-clipping-norm = 0.5\n"
        "dp-delta = 1e-6\n"
    )
    s = load_settings(path)
    assert s.secure_aggregation and s.secagg_quorum == 3 and s.dp == "client"
    assert (s.dp_noise_multiplier, s.dp_clipping_norm, s.dp_delta) == (0.8, 0.5, 1e-6)
    # the per-client norm bound needs each update: off unless given (then refused)
    assert s.max_norm_ratio == 0.0


def test_defaults_are_off_and_the_threshold_is_a_majority():
    s = FLSettings()
    assert not s.secure_aggregation and s.dp == "off" and s.dp_delta == 1e-5
    for n, quorum in [(2, 2), (3, 2), (4, 3), (5, 3), (10, 6)]:
        s = FLSettings.from_dict({"secure_aggregation": True, "min_clients": n})
        assert s.secagg_quorum == quorum


@pytest.mark.parametrize(
    "kw, message",
    [
        (
            {"dp": "client", "dp_noise_multiplier": -0.5},
            "dp-noise-multiplier must be >= 0",
        ),
        ({"dp": "client", "dp_clipping_norm": 0}, "dp-clipping-norm must be positive"),
        ({"dp": "client", "dp_delta": 1.0}, "dp-delta must be < 1"),
        ({"dp": "client", "dp_delta": 0}, "dp-delta must be positive"),
        ({"dp": "everywhere"}, "unknown dp 'everywhere'"),
        ({"dp": "client", "dp_sampled_clients": 3}, "exceeds min-clients 2"),
        ({"dp": "client", "strategy": "fedadam"}, "not fedadam"),
        ({"dp": "client", "max_norm_ratio": 3}, "set max-norm-ratio 0"),
        ({"secure_aggregation": True, "max_norm_ratio": 3}, "set max-norm-ratio 0"),
        (
            {"secure_aggregation": True, "aggregation": "median"},
            "aggregation 'median' needs every client's update",
        ),
        (
            {"secure_aggregation": True, "aggregation": "krum", "min_clients": 5},
            "aggregation 'krum' needs every client's update",
        ),
        (
            {
                "secure_aggregation": True,
                "aggregation": "trimmed-mean",
                "min_clients": 5,
            },
            "aggregation 'trimmed-mean' needs every client's update",
        ),
        ({"secure_aggregation": True, "dp": "server"}, "use dp client"),
        ({"secure_aggregation": True, "min_clients": 1}, "at least 2 clients"),
        (
            {"secure_aggregation": True, "min_clients": 3, "secagg_threshold": 4},
            "secagg-threshold 4 needs at least that many clients per round, got 3",
        ),
        ({"secure_aggregation": True, "secagg_threshold": 1}, "0 (a majority) or >= 2"),
        ({"secure_aggregation": True, "secagg_clipping_range": 0}, "must be positive"),
    ],
)
def test_bad_privacy_settings_are_refused_in_one_line(kw, message):
    with pytest.raises(ValueError) as e:
        FLSettings.from_dict(kw)
    assert message in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--dp-noise-multiplier", "-1"], "--dp-noise-multiplier"),
        (["--dp-clipping-norm", "0"], "--dp-clipping-norm"),
        (["--dp-delta", "1.5"], "--dp-delta"),
        (["--dp-delta", "nan"], "--dp-delta"),
        (["--dp", "local"], "--dp"),
        (["--secagg-threshold", "-2"], "--secagg-threshold"),
    ],
)
def test_bad_privacy_flags_fail_while_parsing(flags, message, capsys):
    from aisyn.fl.cli import add_settings_args

    p = argparse.ArgumentParser()
    add_settings_args(p)
    with pytest.raises(SystemExit):
        p.parse_args(flags)
    [line] = capsys.readouterr().err.strip().splitlines()[-1:]
    assert message in line


def test_privacy_flags_parse():
    from aisyn.fl.cli import add_settings_args, settings_from_args

    p = argparse.ArgumentParser()
    add_settings_args(p)
    args = p.parse_args(
        [
            "--secure-aggregation",
            "--dp",
            "client",
            "--dp-noise-multiplier",
            "1.2",
            "--dp-clipping-norm",
            "0.3",
            "--min-clients",
            "3",
        ]
    )
    s = settings_from_args(args)
    assert s.secure_aggregation and s.dp == "client" and s.secagg_quorum == 2
    assert (s.dp_noise_multiplier, s.dp_clipping_norm) == (1.2, 0.3)


@pytest.mark.heavy
def test_cli_refuses_secure_aggregation_with_a_robust_aggregation_in_one_line(
    tmp_path,
):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "aisyn.cli",
            "fl",
            "simulate",
            "--base",
            str(tmp_path),
            "--client",
            "a=x",
            "--client",
            "b=y",
            "--client",
            "c=z",
            "--out",
            str(tmp_path / "run"),
            "--secure-aggregation",
            "--aggregation",
            "median",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    [line] = proc.stderr.strip().splitlines()
    assert line.startswith("aisyn: error: ") and "secure aggregation" in line
    assert not (tmp_path / "run").exists()


def test_experiment_compare_passes_federated_settings_through():
    from aisyn.experiments.cli import parse_fl_settings

    assert parse_fl_settings(["secure-aggregation=true", "dp=client"]) == {
        "secure-aggregation": True,
        "dp": "client",
    }
    with pytest.raises(ValueError, match="dp-delta must be < 1"):
        parse_fl_settings(["dp=client", "dp-delta=2"])
