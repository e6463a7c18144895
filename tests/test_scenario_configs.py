"""The ready configurations of scenarios 1-5 (``--config scenarioN`` on
``aisyn train``, ``split train`` and ``split serve``): each table loads into
its command's flags, flags given still win, bad values fail as the flag would."""

import tomllib
from importlib import resources

import pytest

from aisyn.cli import build_parser, main
from aisyn.train.run import read_metrics

#: a table's command, and the required flags a user gives besides --config
COMMANDS = {
    "train": ["train", "--data", "D", "--out", "O"],
    "split-train": ["split", "train", "--data", "D", "--out", "O"],
    "split-serve": ["split", "serve", "--listen", "0.0.0.0:50051", "--model", "tiny"],
}
SCENARIOS = ["scenario1", "scenario2", "scenario3", "scenario4", "scenario5"]


def _table(name: str) -> dict:
    text = (resources.files("aisyn") / "configs" / f"{name}.toml").read_text()
    return tomllib.loads(text)


@pytest.mark.parametrize("name", SCENARIOS)
def test_each_table_sets_its_commands_flags(name):
    tables = {k: v for k, v in _table(name).items() if k in COMMANDS}
    assert tables, f"{name} configures no command"

    for table, values in tables.items():
        args = build_parser().parse_args([*COMMANDS[table], "--config", name])
        for key, value in values.items():
            assert getattr(args, key.replace("-", "_")) == value, (table, key)


def test_flags_given_win_wherever_they_stand():
    before = ["split", "train", "--lr", "5e-4", "--data", "D", "--out", "O"]

    args = build_parser().parse_args([*before, "--config", "scenario1", "--cut=u:2,2"])

    assert args.lr == 5e-4 and args.cut == "u:2,2"
    assert args.pipeline == 2 and args.mode == "grpc"  # the rest from the file


def test_a_table_may_set_a_required_flag(tmp_path):
    cfg = tmp_path / "mine.toml"
    cfg.write_text('[split-serve]\ncut = "u:1,2"\nlisten = "127.0.0.1:0"\n')

    args = build_parser().parse_args(
        ["split", "serve", "--model", "tiny", "--config", str(cfg)]
    )

    assert (args.cut, args.listen) == ("u:1,2", "127.0.0.1:0")


@pytest.mark.parametrize(
    ("toml", "message"),
    [
        ("[train]\nbatch-size = 0\n", "mine.toml [train] batch-size: must be >= 1"),
        ("[train]\nwarmup = 'soon'\n", "[train] warmup:"),
        ("[train]\nbatchsize = 4\n", "'batchsize' is not a flag of this command"),
        ("[train]\neod-reset = 1\n", "eod-reset: must be true or false"),
        ("[train\n", "not valid TOML"),
    ],
)
def test_a_bad_value_fails_in_one_line_naming_it(tmp_path, capsys, toml, message):
    cfg = tmp_path / "mine.toml"
    cfg.write_text(toml)

    with pytest.raises(SystemExit) as e:
        main(["train", "--data", "D", "--out", "O", "--config", str(cfg)])

    assert e.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_an_unknown_name_lists_the_shipped_ones(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--data", "D", "--out", "O", "--config", "scenario9"])

    assert "shipped: scenario1, scenario2" in capsys.readouterr().err


def test_scenario5_trains(tmp_path, news_data, model_file):
    run = tmp_path / "s5"

    code = main(
        [
            "train",
            "--config",
            "scenario5",
            "--model",
            str(model_file),
            "--data",
            str(news_data),
            "--out",
            str(run),
            "--steps",
            "2",
            "--quiet",
        ]
    )

    assert code == 0
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl")] == [1, 2]
    assert (run / "config.json").read_text().count('"batch_size": 16') == 1
