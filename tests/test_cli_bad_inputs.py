"""Bad command-line input ends in one line on stderr, never a traceback.

Each case of ``BAD_INPUTS`` is a finding of the command-line review (issue 8):
a traceback, a silently accepted value or a misleading message. Every one must
exit with a non-zero status, name the problem on stderr's last line and print
no traceback. Commands run in-process (``main(argv)``) to keep this fast.
"""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from aisyn import validate
from aisyn.cli import build_parser, main

SENTENCE = "国务院总理今天在北京会见了来访的外国代表团，双方就经济合作交换了意见。"


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Inputs the cases point at: bad files, an empty folder, a small data set."""
    root = tmp_path_factory.mktemp("bad_inputs")
    (root / "garbage.pem").write_text("this is not a certificate\n")
    (root / "garbage.key").write_text("this is not a key\n")
    model = {
        "vocab_size": 8000,
        "hidden_size": "128",  # a string where a number belongs
        "num_layers": 2,
        "num_heads": 4,
        "ffn_size": 256,
        "seq_len": 32,
    }
    (root / "string_field.json").write_text(json.dumps(model))
    (root / "nan_lr.toml").write_text("[federated]\nlr = nan\n")
    (root / "empty").mkdir()
    # A small .txt corpus prepares in a fraction of a second (the news corpus
    # takes seconds to load).
    corpus = root / "corpus.txt"
    corpus.write_text(
        "".join(f"{i}: {SENTENCE * 3}\n" for i in range(60)), encoding="utf-8"
    )
    code = main(
        ["prepare", "--corpus", str(corpus), "--out", str(root / "data")]
        + ["--seq-len", "32"]
    )
    assert code == 0
    code = main(
        ["prepare-sft", "--corpus", str(corpus), "--out", str(root / "sft")]
        + ["--seq-len", "32"]
    )
    assert code == 0
    # A base run whose tokenizer is not the one the data were made with
    other = root / "other_base"
    other.mkdir()
    (other / "config.json").write_text(
        json.dumps({"kind": "train", "tokenizer": {"sha256": "0" * 64}})
    )
    (other / "model.safetensors").write_bytes(b"")
    return root


def train_argv(files, *extra: str) -> list[str]:
    return [
        "train",
        "--data",
        str(files / "data"),
        "--out",
        str(files / "run"),
        "--quiet",
        *extra,
    ]


def split_train_argv(files, *extra: str) -> list[str]:
    return [
        "split",
        "train",
        "--data",
        str(files / "data"),
        "--out",
        str(files / "split_run"),
        "--quiet",
        *extra,
    ]


def split_sft_argv(files, *extra: str) -> list[str]:
    return [
        "split",
        "train",
        "--sft",
        str(files / "sft"),
        "--out",
        str(files / "split_sft_run"),
        "--quiet",
        *extra,
    ]


def plan_argv(*extra: str) -> list[str]:
    return ["split", "plan", "--model", "tiny", "--party", "A:1:inf"] + [
        "--party",
        "B:1:inf",
        *extra,
    ]


def serve_argv(files, *extra: str) -> list[str]:
    return ["split", "serve", "--model", "tiny", "--cut", "u:1,1", *extra]


# A device that is not there: plain "cuda" on a CPU box, one index too many
# where there are GPUs.
MISSING_CUDA = (
    f"cuda:{torch.cuda.device_count()}" if torch.cuda.is_available() else "cuda"
)

# (id, argv from the files fixture, what stderr's last line must say)
BAD_INPUTS = [
    # tracebacks
    ("log-every 0", lambda f: train_argv(f, "--log-every", "0"), "--log-every"),
    ("device cuda", lambda f: train_argv(f, "--device", MISSING_CUDA), "--device"),
    ("device foo", lambda f: train_argv(f, "--device", "foo"), "--device"),
    (
        "eval device foo",
        lambda f: ["eval", "--run", str(f), "--device", "foo"],
        "--device",
    ),
    # ran into the OOM killer
    (
        "batch-size 100000",
        lambda f: train_argv(f, "--batch-size", "100000", "--device", "cpu"),
        "memory",
    ),
    (
        "split batch-size 100000",
        lambda f: split_train_argv(f, "--batch-size", "100000", "--device", "cpu"),
        "memory",
    ),
    # listened on another port than asked
    (
        "listen port 99999",
        lambda f: serve_argv(f, "--listen", "127.0.0.1:99999", "--insecure"),
        "99999",
    ),
    (
        "peer port 99999",
        lambda f: split_train_argv(f, "--mode", "grpc", "--peer", "127.0.0.1:99999"),
        "99999",
    ),
    (
        "peer without port",
        lambda f: split_train_argv(f, "--peer", "localhost"),
        "HOST:PORT",
    ),
    (
        "superlink port 70000",
        lambda f: (
            ["fl", "client", "--superlink", "127.0.0.1:70000"]
            + ["--name", "a", "--data", "d", "--base", "b", "--out", "o"]
        ),
        "70000",
    ),
    (
        "fl server port -1",
        lambda f: ["fl", "server", "--base", "b", "--out", "o", "--port", "-1"],
        "--port",
    ),
    # accepted silently
    ("ckpt-every -1", lambda f: train_argv(f, "--ckpt-every", "-1"), "--ckpt-every"),
    ("eval-every -1", lambda f: train_argv(f, "--eval-every", "-1"), "--eval-every"),
    ("warmup -5", lambda f: train_argv(f, "--warmup", "-5"), "--warmup"),
    ("grad-clip -1", lambda f: train_argv(f, "--grad-clip", "-1"), "--grad-clip"),
    ("lr nan", lambda f: train_argv(f, "--lr", "nan"), "--lr"),
    ("lr inf", lambda f: train_argv(f, "--lr", "inf"), "--lr"),
    ("plan pipeline -5", lambda f: plan_argv("--pipeline", "-5"), "--pipeline"),
    (
        "split train pipeline -5",
        lambda f: split_train_argv(f, "--pipeline", "-5"),
        "--pipeline",
    ),
    (
        "prepare seq-len 0",
        lambda f: (
            ["prepare", "--corpus", "news", "--out", str(f / "p")] + ["--seq-len", "0"]
        ),
        "--seq-len",
    ),
    (
        "prepare max-docs -1",
        lambda f: (
            ["prepare", "--corpus", "news", "--out", str(f / "p")]
            + ["--max-docs", "-1"]
        ),
        "--max-docs",
    ),
    (
        "eval max-items -1",
        lambda f: ["eval", "--run", str(f), "--max-items", "-1"],
        "--max-items",
    ),
    (
        "train resume empty folder",
        lambda f: ["train", "--data", "d", "--out", str(f / "empty"), "--resume"],
        "nothing to resume",
    ),
    (
        "train resume with a value other than auto",
        lambda f: ["train", "--data", "d", "--out", str(f / "r"), "--resume", "yes"],
        "--resume takes no value or 'auto'",
    ),
    (
        "finetune resume empty folder",
        lambda f: (
            ["finetune", "--base", "b", "--data", "d", "--out", str(f / "empty")]
            + ["--resume"]
        ),
        "nothing to resume",
    ),
    (
        "split train resume empty folder",
        lambda f: (
            ["split", "train", "--data", "d", "--out", str(f / "empty")] + ["--resume"]
        ),
        "nothing to resume",
    ),
    (
        "federated lr nan",
        lambda f: (
            ["fl", "simulate", "--base", "b", "--client", "a=x"]
            + ["--out", str(f / "fl"), "--config", str(f / "nan_lr.toml")]
        ),
        "lr must be a finite number",
    ),
    (
        "federated flag server-momentum 1.5",
        lambda f: (
            ["fl", "simulate", "--base", "b", "--client", "a=x"]
            + ["--out", str(f / "fl"), "--server-momentum", "1.5"]
        ),
        "--server-momentum",
    ),
    (
        "federated flag the strategy does not take",
        lambda f: (
            ["fl", "simulate", "--base", "b", "--client", "a=x"]
            + ["--out", str(f / "fl"), "--proximal-mu", "0.1"]
        ),
        "--proximal-mu is fedprox's; strategy fedavg does not take it",
    ),
    # split fine-tuning: data and base that do not go together
    (
        "split train --sft and --data",
        lambda f: split_sft_argv(f, "--data", str(f / "data")),
        "give --data SHARDS (pre-training) or --sft SFT_DIR (fine-tuning), not both",
    ),
    (
        "split train neither --data nor --sft",
        lambda f: ["split", "train", "--out", str(f / "split_run"), "--quiet"],
        "or --sft SFT_DIR (fine-tuning), one of them",
    ),
    (
        "split train noise without a clipping bound",
        lambda f: (
            ["split", "train", "--data", str(f / "data"), "--out", str(f / "dp_run")]
            + ["--dp-backward-noise", "0.5", "--quiet"]
        ),
        "--dp-backward-noise needs --dp-backward-clip",
    ),
    (
        "split train negative noise",
        lambda f: (
            ["split", "train", "--data", str(f / "data"), "--out", str(f / "dp_run")]
            + ["--dp-forward-clip", "1", "--dp-forward-noise", "-1"]
        ),
        "--dp-forward-noise: must be >= 0, got -1",
    ),
    (
        "split train delta without noise",
        lambda f: (
            ["split", "train", "--data", str(f / "data"), "--out", str(f / "dp_run")]
            + ["--dp-forward-clip", "1", "--dp-delta", "1e-6"]
        ),
        "--dp-delta: no Gaussian noise to account",
    ),
    (
        "split train --sft without a base",
        lambda f: split_sft_argv(f),
        "split fine-tuning starts from a pre-trained base; give --init-from BASE",
    ),
    (
        "split train --sft from a missing base",
        lambda f: split_sft_argv(f, "--init-from", str(f / "no_such_base")),
        "no_such_base: no such base model",
    ),
    (
        "split train --sft data of another tokenizer than the base's",
        lambda f: split_sft_argv(f, "--init-from", str(f / "other_base")),
        "but the base model",
    ),
    # misleading messages
    (
        "garbage PEM certificate",
        lambda f: (
            serve_argv(f, "--listen", "127.0.0.1:0")
            + [
                "--tls-cert",
                str(f / "garbage.pem"),
                "--tls-key",
                str(f / "garbage.key"),
            ]
            + ["--tls-ca", str(f / "garbage.pem")]
        ),
        "garbage.pem: not a PEM certificate",
    ),
    (
        "garbage PEM key",
        lambda f: (
            ["fl", "server", "--base", "b", "--out", "o"]
            + ["--tls-key", str(f / "garbage.key")]
        ),
        "garbage.key: not a PEM private key",
    ),
    (
        "the reference table with a regime's own strategy",
        lambda f: [
            "experiment",
            "compare",
            "--preset",
            "reference-ci",
            "--strategy",
            "fedprox",
            "--out",
            str(f / "table"),
        ],  # fmt: skip
        "runs the whole table (every regime, method, partition and seed): drop "
        "--strategy",
    ),
    (
        "model JSON with a string for a number",
        lambda f: (
            ["split", "plan", "--model", str(f / "string_field.json")]
            + ["--party", "A:1:inf", "--party", "B:1:inf"]
        ),
        "hidden_size must be an integer, got '128'",
    ),
]


@pytest.fixture
def no_training(monkeypatch):
    """Fail a case that gets as far as building a model to train, rather than
    let it run: without the memory check, ``--batch-size 100000`` allocates
    until the OOM killer ends the test run (and whatever else it picks)."""
    import aisyn.split.client.train
    import aisyn.train.pretrain

    def refuse(*args, **kwargs):
        raise AssertionError("a bad input got as far as building the model")

    monkeypatch.setattr(aisyn.train.pretrain, "build_model", refuse)
    monkeypatch.setattr(aisyn.split.client.train, "PartyState", refuse)


def run(argv, capsys) -> tuple[int, str, str]:
    try:
        code = main(argv)
    except SystemExit as e:  # argparse's errors
        code = e.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.parametrize(
    ("make_argv", "expected"),
    [pytest.param(argv, expected, id=name) for name, argv, expected in BAD_INPUTS],
)
def test_bad_input_is_one_line_error(make_argv, expected, files, capsys, no_training):
    code, out, err = run(make_argv(files), capsys)

    assert code not in (0, None)
    assert "Traceback" not in out + err
    last = err.strip().splitlines()[-1]
    assert expected in last, err


# --- every numeric flag of every command is validated ---------------------------


def _parsers(parser, prefix=()):
    yield prefix, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _parsers(sub, (*prefix, name))


def _is_numeric(action) -> bool:
    try:
        return isinstance(action.type("1"), int | float)
    except (TypeError, ValueError, argparse.ArgumentTypeError):
        return False


def numeric_flags():
    """Every flag of every (sub)command whose value is a number."""
    for prefix, parser in _parsers(build_parser()):
        for action in parser._actions:
            if action.type is not None and _is_numeric(action):
                flag = action.option_strings[-1]
                yield pytest.param(action, id=" ".join((*prefix, flag)))


@pytest.mark.parametrize("action", list(numeric_flags()))
def test_every_numeric_flag_refuses_garbage_and_nan(action):
    assert action.type not in (int, float), "use a type from aisyn.validate"
    for text in ("x", "nan", "inf", "1e999"):
        with pytest.raises(argparse.ArgumentTypeError):
            action.type(text)


def test_numeric_flag_types_enforce_their_ranges():
    bad = {
        validate.positive_int: ["0", "-1", "1.5"],
        validate.nonneg_int: ["-1"],
        validate.positive_float: ["0", "-0.1"],
        validate.nonneg_float: ["-1e-9"],
        validate.probability: ["1.01", "-0.5"],
        validate.port: ["0", "65536", "99999", "-1"],
        validate.host_port: ["127.0.0.1:99999", "127.0.0.1:0", "host", ":80", "::1:80"],
        validate.listen_address: ["127.0.0.1:65536", "[::1:80"],
    }
    for convert, texts in bad.items():
        for text in texts:
            with pytest.raises(argparse.ArgumentTypeError):
                convert(text)
    assert validate.listen_address("127.0.0.1:0") == "127.0.0.1:0"
    assert validate.host_port("[::1]:50051") == "[::1]:50051"
    assert validate.nonneg_float("0") == 0.0


# --- configs that arrive from files and peers ---------------------------------------


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("lr", float("nan")),
        ("lr", float("inf")),
        ("min_lr", -1.0),
        ("warmup_steps", -5),
        ("grad_clip", -1.0),
        ("weight_decay", float("nan")),
        ("log_every", 0),
        ("ckpt_every", -1),
        ("eval_every", -1),
        ("keep_checkpoints", 0),
        ("eval_batches", 0),
    ],
)
def test_train_config_checks_its_own_ranges(field, value):
    from aisyn.train.config import TrainConfig

    with pytest.raises(ValueError, match=field):
        TrainConfig(**{field: value})


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("lr", "nan"),
        ("round-timeout", "inf"),
        ("server-momentum", "1.0"),
        ("beta-2", "-0.1"),
        ("tau", "0.0"),
        ("proximal-mu", "-1.0"),
        ("eval-items", "-1"),
        ("seed", "-3"),
    ],
)
def test_federated_settings_check_every_number(key, value, tmp_path):
    from aisyn.fl.settings import load_settings

    path = tmp_path / "s.toml"
    path.write_text(f"{key} = {value}\n")

    with pytest.raises(ValueError, match=key):
        load_settings(path)


def test_model_config_names_the_field_of_a_wrong_type():
    from aisyn.model.pangu import PanguConfig

    with pytest.raises(ValueError, match="dropout must be a number, got 'x'"):
        PanguConfig.from_dict({"dropout": "x"})
    with pytest.raises(ValueError, match="num_layers must be an integer, got 2.0"):
        PanguConfig.from_dict({"num_layers": 2.0})
    assert PanguConfig.from_dict({"dropout": 0}).dropout == 0


def test_valid_tls_files_pass(tmp_path):
    from aisyn.link.certs import make_dev_certs

    certs = make_dev_certs(tmp_path)
    assert validate.pem_certificates(str(certs.ca_cert)) == str(certs.ca_cert)
    assert validate.pem_private_key(str(certs.server_key)) == str(certs.server_key)
    with pytest.raises(argparse.ArgumentTypeError, match="no such file"):
        validate.pem_certificates(str(tmp_path / "missing.pem"))


def test_memory_estimate_lets_ordinary_runs_through():
    from aisyn.model.families import load_config
    from aisyn.train.memory import available_bytes, whole_model_bytes

    tiny = load_config("tiny")
    default_run = whole_model_bytes(tiny, 8, 128, "fp32")
    assert 1e6 < default_run < 1e9  # parameters + AdamW + activations, ~150 MB
    assert whole_model_bytes(tiny, 100_000, 128, "fp32") > 1e12
    assert available_bytes(torch.device("cpu")) > default_run


@pytest.mark.parametrize(
    ("files", "expected"),
    [
        (
            {
                "memory.max": "4000",
                "memory.current": "3000",
                "memory.stat": "anon 1000\nfile 2500\n",
            },
            3500.0,  # the page cache is reclaimable
        ),
        ({"memory.max": "max", "memory.current": "3000"}, None),
        (
            {
                "memory/memory.limit_in_bytes": "4000",
                "memory/memory.usage_in_bytes": "1000",
                "memory/memory.stat": "cache 10\ntotal_cache 200\n",
            },
            3200.0,
        ),
        ({"memory/memory.limit_in_bytes": str(2**63 - 4096)}, None),
        ({}, None),
    ],
    ids=["v2", "v2 unlimited", "v1", "v1 unlimited", "none"],
)
def test_cgroup_limit_is_read(files, expected, tmp_path):
    from aisyn.train.memory import cgroup_available

    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)

    assert cgroup_available(tmp_path) == expected


def test_memory_check_names_the_estimate_and_can_be_skipped(monkeypatch):
    from aisyn.train import memory

    monkeypatch.setattr(memory, "available_bytes", lambda device: 2**30)
    with pytest.raises(ValueError, match=r"about 2\.00 GiB .* only 1\.00 GiB"):
        memory.check_fits(2**31, torch.device("cpu"), "training")
    memory.check_fits(2**29, torch.device("cpu"), "training")
    monkeypatch.setenv(memory.SKIP_ENV, "1")
    memory.check_fits(2**31, torch.device("cpu"), "training")


def test_real_bugs_keep_their_traceback(monkeypatch):
    import aisyn.cli

    def broken(args):
        raise KeyError("a bug")

    monkeypatch.setattr(aisyn.cli, "cmd_demo", broken)  # bound when main parses

    with pytest.raises(KeyError, match="a bug"):
        main(["demo"])


def test_a_failed_federated_run_is_one_line_not_a_traceback(monkeypatch, capsys):
    """Before: FederatedRunError was a plain RuntimeError, printed as a bug."""
    import aisyn.cli
    from aisyn.fl.launch import FederatedRunError

    def failed(args):
        raise FederatedRunError("federated run failed (superlink); see run/x.log")

    monkeypatch.setattr(aisyn.cli, "cmd_demo", failed)
    code = main(["demo"])
    err = capsys.readouterr().err
    assert code != 0 and "Traceback" not in err
    assert err.strip().splitlines()[-1].endswith("see run/x.log")


@pytest.mark.parametrize(
    ("flag", "value", "expected"),
    [
        ("--max-sessions", "0", "argument --max-sessions: must be >= 1, got 0"),
        ("--keep-checkpoints", "nan", "argument --keep-checkpoints"),
        ("--exit-after", "-3", "argument --exit-after: must be >= 1"),
        ("--idle-timeout", "nan", "argument --idle-timeout: timeout 'nan'"),
        ("--hello-timeout", "inf", "argument --hello-timeout: timeout 'inf'"),
        ("--idle-timeout", "soon", "argument --idle-timeout: timeout 'soon'"),
    ],
)
def test_split_serve_refuses_bad_serving_options_by_the_flag(
    flag, value, expected, capsys, tmp_path
):
    """``aisyn split serve``'s declared options (``ServeOptions``): a bad
    value is refused by its flag, in one line, before anything is loaded."""
    argv = ["split", "serve", "--listen", "127.0.0.1:0", "--model", "tiny",
            "--out", str(tmp_path / "b"), flag, value]  # fmt: skip
    code, _, err = run(argv, capsys)
    assert code == 2
    assert expected in err.strip().splitlines()[-1]
    assert not (tmp_path / "b").exists()


def test_serve_options_hold_a_config_to_the_flags_bounds():
    from aisyn.split.centre.options import ServeOptions

    assert ServeOptions().max_sessions == 1
    with pytest.raises(ValueError, match="--max-sessions must be >= 1, got 0"):
        ServeOptions(max_sessions=0)
    with pytest.raises(ValueError, match="--keep-checkpoints must be an integer"):
        ServeOptions(keep_checkpoints=2.5)
