"""How a split session starts and ends, as a user sees it (issue 17): a
normal end logs a normal end; a refused or failed start leaves no run folder
behind on either party, so the retry is not told "already holds a run"."""

from __future__ import annotations

import json
import logging
import shlex
from pathlib import Path

import pytest
from conftest import CUT
from test_server_hardening import fresh_hello

from aisyn.link.errors import HandshakeError
from aisyn.model.segments import parse_partition
from aisyn.split.session import open_local


def test_a_normal_end_logs_a_normal_end(tmp_path, split_config, caplog):
    caplog.set_level(logging.INFO, logger="aisyn")
    partition = parse_partition(CUT, split_config)
    with open_local(
        split_config,
        partition,
        tmp_path / "b",
        fresh_hello(split_config),
        codec="none",
        device="cpu",
    ) as opened:
        opened.link.close()  # A is done: BYE between rounds
        opened.thread.join(30)
    assert not opened.errors
    assert "the data party closed it after 0 round(s)" in caplog.text
    assert "never arrived" not in caplog.text
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], [
        r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING
    ]


# --- the docs' command lines, as written -----------------------------------------

DOCS = Path(__file__).parents[2] / "docs"


def docs_command(doc: str, starts: str) -> list[str]:
    """The shell command in ``docs/doc`` that starts with ``starts`` (with its
    continuation lines), as argv after ``aisyn``."""
    lines = (DOCS / doc).read_text(encoding="utf-8").splitlines()
    for i, line in enumerate(lines):
        if line.startswith(starts):
            text = line
            while text.endswith("\\"):
                i += 1
                text = text[:-1] + lines[i]
            return shlex.split(text.split("#")[0])[1:]
    raise AssertionError(f"no command starting {starts!r} in docs/{doc}")


def with_values(argv: list[str], **values: str) -> list[str]:
    """``argv`` with flag values replaced (``out="..."`` sets ``--out``)."""
    argv = list(argv)
    for name, value in values.items():
        flag = "--" + name.replace("_", "-")
        argv[argv.index(flag) + 1] = value
    return argv


def test_the_quick_start_pipeline_line_pipelines():
    from aisyn.cli import build_parser
    from aisyn.split.client.options import check_pipeline
    from aisyn.train.flags import train_config_from_args

    argv = docs_command("split.md", "aisyn split train --mode grpc --spawn-backbone")
    args = build_parser().parse_args(argv)
    args.seed = 1  # cmd_train draws a secret one
    assert args.pipeline == 2
    cfg = train_config_from_args(args)
    assert cfg.grad_accum >= 2
    check_pipeline(args.pipeline, cfg)  # does not refuse


def test_pipeline_with_one_micro_batch_is_refused_in_one_line(
    tmp_path, news_data, capsys
):
    from aisyn.cli import main

    out = tmp_path / "run"
    argv = ["split", "train", "--mode", "local", "--data", str(news_data)]
    rc = main([*argv, "--out", str(out), "--steps", "2", "--pipeline", "2"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2
    assert len(err) == 1 and err[0].startswith("aisyn: error: --pipeline 2"), err
    assert "--micro-batch-size to a divisor of 8 below it, e.g. 4" in err[0]
    assert not out.exists()  # refused before anything was written


# --- both parties resolve a preset's vocabulary the same way ----------------------


def data_tokenizer(data: Path) -> dict:
    from aisyn.data.shards import open_many

    return open_many([data], "train")[0].tokenizer_info


def data_party_hello(argv: list[str], data: Path) -> dict:
    """The hello ``aisyn split train ARGV`` sends for data prepared at ``data``
    (its model config as split_train resolves it), built on the meta device."""
    from aisyn.cli import build_parser
    from aisyn.model.segments import COMPUTE_PARTY, init_seeds
    from aisyn.split import protocol as proto
    from aisyn.train.flags import train_config_from_args
    from aisyn.train.models import model_config_for

    args = build_parser().parse_args(argv)
    args.seed = 7
    train = train_config_from_args(args)
    tok = data_tokenizer(data)
    mcfg = model_config_for(args.model, tok, 32)
    partition = parse_partition(args.cut, mcfg)
    return proto.hello(
        purpose="train",
        run_id="docs",
        model=mcfg.to_dict(),
        partition=partition.to_dict(),
        train=train,
        init_seeds=init_seeds(mcfg, partition, COMPUTE_PARTY, train.seed),
    )


def test_the_docs_serve_line_takes_the_docs_data_party(
    tmp_path, news_data, monkeypatch
):
    """docs/split.md's two-machine lines, as written (`--model 2.6B`, the
    shipped 8 000-piece tokenizer at A): B, a preset on the meta device here,
    accepts A's hello instead of refusing "vocab_size differs"."""
    from aisyn.cli import build_parser
    from aisyn.link.certs import make_dev_certs
    from aisyn.link.memory import IN_PROCESS
    from aisyn.model.families import load_config
    from aisyn.split import protocol as proto
    from aisyn.split.backbone.compute_party import ComputeParty

    monkeypatch.chdir(tmp_path)  # the lines' files, relative as written
    certs = make_dev_certs(tmp_path / "certs")
    for name, src in {
        "a.pem": certs.client_cert,
        "a.key": certs.client_key,
        "b.pem": certs.server_cert,
        "b.key": certs.server_key,
        "ca.pem": certs.ca_cert,
    }.items():
        Path(name).write_bytes(src.read_bytes())
    Path("token").write_text("docs-token")

    serve = build_parser().parse_args(
        docs_command("split.md", "aisyn split serve --listen 0.0.0.0:50051")
    )
    cfg = load_config(serve.model)
    assert serve.model == "2.6B" and cfg.vocab_size == 40000
    party = ComputeParty(cfg, parse_partition(serve.cut, cfg), tmp_path / "b")
    hello = data_party_hello(
        docs_command("split.md", "aisyn split train --mode grpc --peer b.example"),
        news_data,
    )
    assert hello["model"]["vocab_size"] == data_tokenizer(news_data)["vocab_size"]
    reply, session = party.negotiate(proto.encode_json(hello), IN_PROCESS)
    assert proto.parse_reply(reply)["start_step"] == 0
    assert session.cfg.to_dict() == hello["model"]  # B's run records A's model
    assert not (tmp_path / "b").exists()


def test_a_preset_vocabulary_at_b_trains_with_the_tokenizers_at_a(
    tmp_path, split_config, news_data, token_file
):
    """Scaled down from the docs' lines (only sizes differ): both parties given
    a config of the reference's 40 000 pieces, A's data of 8 000, over gRPC."""
    from dataclasses import replace

    from conftest import start_server, train_cfg

    from aisyn.split.client.merge import merge
    from aisyn.split.client.train import split_train
    from aisyn.split.session import SplitOptions
    from aisyn.split.transport import LinkSettings

    preset = replace(split_config, vocab_size=40000)
    listen = LinkSettings("127.0.0.1:0", token_file=str(token_file), insecure=True)
    with start_server(preset, tmp_path / "b", listen) as server:
        peer = LinkSettings(server.address, token_file=str(token_file), insecure=True)
        out = tmp_path / "a"
        split_train(
            preset,
            [news_data],
            out,
            train_cfg(steps=2, ckpt_every=2),
            SplitOptions(cut=CUT, mode="grpc", peer=peer),
            progress=False,
        )
    (b_run,) = (tmp_path / "b").iterdir()
    vocab = data_tokenizer(news_data)["vocab_size"]
    b_model = json.loads((b_run / "config.json").read_text())["model"]
    assert b_model["vocab_size"] == vocab == 8000
    merge(out, tmp_path / "b", tmp_path / "merged")  # the two records agree


def test_a_base_fixes_the_compute_partys_vocabulary(tmp_path, split_config, news_data):
    """`aisyn train --model PRESET` sizes the base to the tokenizer; B serving
    `--model PRESET --init-from BASE` takes the base's vocabulary, not the
    preset's, and accepts the data party starting from that base."""
    from dataclasses import replace

    from conftest import train_cfg

    from aisyn.link.memory import IN_PROCESS
    from aisyn.model.segments import DATA_PARTY
    from aisyn.split import protocol as proto
    from aisyn.split.backbone.compute_party import ComputeParty
    from aisyn.split.party import open_base
    from aisyn.train.models import model_config_for
    from aisyn.train.pretrain import train

    preset = replace(split_config, vocab_size=40000)
    train(preset, [news_data], tmp_path / "base", train_cfg(steps=1), progress=False)
    partition = parse_partition(CUT, preset)
    party = ComputeParty(preset, partition, tmp_path / "b", init_from=tmp_path / "base")
    assert party.cfg.vocab_size == 8000 and party.vocab_fixed
    mcfg = model_config_for(preset, data_tokenizer(news_data), 32)
    base = open_base(tmp_path / "base", mcfg, partition, DATA_PARTY)
    hello = proto.hello(
        purpose="train",
        run_id="based",
        model=mcfg.to_dict(),
        partition=partition.to_dict(),
        train=train_cfg(),
        init=base.fingerprint,
    )
    reply, _ = party.negotiate(proto.encode_json(hello), IN_PROCESS)
    assert proto.parse_reply(reply)["start_step"] == 0
    # Any other vocabulary is refused: the base's embedding fixes it.
    hello["model"] = {**hello["model"], "vocab_size": 9000}
    with pytest.raises(HandshakeError, match=r"differs .* in \['vocab_size'\]"):
        party.negotiate(proto.encode_json(hello), IN_PROCESS)


# --- a refused or failed start leaves nothing behind ------------------------------


def snapshot(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def test_a_refused_start_leaves_no_run_folder_and_the_retry_works(
    tmp_path, split_config, news_data, token_file
):
    from conftest import start_server, train_cfg

    from aisyn.split.client.train import split_train
    from aisyn.split.session import SplitOptions
    from aisyn.split.transport import LinkSettings

    listen = LinkSettings("127.0.0.1:0", token_file=str(token_file), insecure=True)
    out = tmp_path / "a"
    cfg = train_cfg(steps=2, ckpt_every=2)

    def run(server, **kwargs) -> dict:
        peer = LinkSettings(server.address, token_file=str(token_file), insecure=True)
        opts = SplitOptions(cut=CUT, mode="grpc", peer=peer)
        return split_train(
            split_config, [news_data], out, cfg, opts, progress=False, **kwargs
        )

    with (
        start_server(split_config, tmp_path / "wrong", listen, cut="u:1,2") as wrong,
        start_server(split_config, tmp_path / "b", listen) as right,
    ):
        with pytest.raises(HandshakeError, match="cut .* differs"):
            run(wrong)
        assert not out.exists()
        assert run(right)["steps"] == 2  # the same command, not "already holds"
        before = snapshot(out)
        cfg = train_cfg(steps=4, ckpt_every=2)  # a --resume with more steps
        with pytest.raises(HandshakeError, match="cut .* differs"):
            run(wrong, resume=True)
        assert snapshot(out) == before  # its config.json as it was
    assert not (tmp_path / "wrong").exists() or not any((tmp_path / "wrong").iterdir())


def test_a_failed_first_save_leaves_no_folder_at_the_compute_party(
    tmp_path, split_config, news_data, monkeypatch
):
    from conftest import train_cfg

    from aisyn.split.backbone import compute_party
    from aisyn.split.client.data_party import SplitError
    from aisyn.split.client.train import split_train
    from aisyn.split.session import COMPUTE_DIR, SplitOptions

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(compute_party.ckpt, "save", disk_full)
    out = tmp_path / "a"
    with pytest.raises(SplitError, match="could not checkpoint step 2"):
        split_train(
            split_config,
            [news_data],
            out,
            train_cfg(steps=2, ckpt_every=2),
            SplitOptions(cut=CUT),
            progress=False,
        )
    assert list((out / COMPUTE_DIR).iterdir()) == []


# --- the quick start's lines, run as written (a tiny --steps) ---------------------


def run_docs_line(starts: str, news_data: Path, tmp_path: Path) -> Path:
    from aisyn.cli import main

    argv = docs_command("split.md", starts)
    out = tmp_path / "run"
    argv = with_values(argv, data=str(news_data), out=str(out), steps="2")
    assert main(argv) == 0
    return out


@pytest.mark.heavy
def test_the_quick_start_local_line_runs(tmp_path, news_data):
    out = run_docs_line("aisyn split train --mode local", news_data, tmp_path)
    assert (out / "checkpoints").is_dir()


@pytest.mark.slow
def test_the_quick_start_grpc_line_runs_pipelined(tmp_path, news_data):
    out = run_docs_line(
        "aisyn split train --mode grpc --spawn-backbone", news_data, tmp_path
    )
    split = json.loads((out / "config.json").read_text())["split"]
    assert split["window"] == 2 and split["codec"] == "int8"


@pytest.mark.heavy
def test_the_quick_start_localhost_pair_runs_as_written(tmp_path, news_data):
    """docs/split.md's two commands at `tiny` on localhost, credentials from
    its `aisyn certs` line: B in its own process (on a free port instead of
    50051, ending after the session), A for 2 steps."""
    import os
    import subprocess
    import sys
    import time

    from aisyn.cli import main
    from aisyn.model.families import load_config

    cwd = os.getcwd()
    os.chdir(tmp_path)  # the lines' files, relative as written
    server = None
    try:
        assert main(docs_command("split.md", "aisyn certs --out creds")) == 0
        serve = docs_command("split.md", "aisyn split serve --listen 127.0.0.1:50051")
        assert serve[serve.index("--model") + 1] == "tiny"
        partition = parse_partition(
            serve[serve.index("--cut") + 1], load_config("tiny")
        )
        assert partition.is_u_shape
        address = tmp_path / "address"
        serve = with_values(serve, listen="127.0.0.1:0")
        server = subprocess.Popen(
            [sys.executable, "-m", "aisyn.cli", *serve, "--address-file", str(address)]
            + ["--exit-after", "1", "--device", "cpu"],
            env={**os.environ, "OMP_NUM_THREADS": "1"},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 120
        while not address.exists():
            assert server.poll() is None, f"B ended early ({server.returncode})"
            assert time.monotonic() < deadline, "B never listened"
            time.sleep(0.05)
        port = address.read_text().strip().rsplit(":", 1)[1]
        train = docs_command(
            "split.md", "aisyn split train --mode grpc --peer localhost"
        )
        out = tmp_path / "runs" / "a"
        train = with_values(
            train,
            peer=f"localhost:{port}",
            data=str(news_data),
            out=str(out),
            steps="2",
        )
        assert main(train) == 0
        assert (out / "checkpoints" / "step_00000002").is_dir()
        assert server.wait(60) == 0  # B served the one session and ended
    finally:
        os.chdir(cwd)
        if server is not None and server.poll() is None:
            server.kill()
            server.wait(10)
