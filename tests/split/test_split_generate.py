"""Split generation equals unsplit generation: the data party's decoder, with
the compute party running the middle through the link (in-process and over
gRPC), gives the merged model's tokens, greedy and sampled with a seed, and
its logits at every step; the compute party checks every generation round."""

from __future__ import annotations

import pytest
import torch
from conftest import CUT, start_server, train_cfg

from aisyn.cli import main
from aisyn.link.errors import LinkError
from aisyn.model.families import config_from_dict
from aisyn.model.generate import Decoder, Sampling, decode, generate
from aisyn.model.segments import parse_partition
from aisyn.split import protocol as proto
from aisyn.split.client.evaluate import open_data_session
from aisyn.split.client.merge import merge
from aisyn.split.client.train import split_train
from aisyn.split.session import COMPUTE_DIR, SplitOptions, open_local
from aisyn.split.transport import LinkSettings
from aisyn.train.models import load_run_model
from aisyn.train.run import RunDir

PROMPT = [9, 417, 23, 1502, 77, 3001]  # ids of split_config's 8000-token vocabulary
NEW = 24  # prompt + new tokens = 30 of seq_len 32
NAN = float("nan")
SAMPLINGS = {
    "greedy": Sampling(),
    "sampled": Sampling(temperature=1.3, top_k=200, top_p=0.95, seed=5),
    # valid values that crashed sampling ("probability tensor contains nan")
    "extreme": Sampling(temperature=1e-45, top_p=1e-300, seed=5),
}


@pytest.fixture(scope="module")
def split_run(tmp_path_factory, news_data, split_config):
    out = tmp_path_factory.mktemp("split_gen") / "run"
    split_train(
        split_config,
        [news_data],
        out,
        train_cfg(steps=3, ckpt_every=3),
        SplitOptions(cut=CUT, mode="local"),
        progress=False,
    )
    return out


@pytest.fixture(scope="module")
def merged(tmp_path_factory, split_run):
    out = tmp_path_factory.mktemp("split_gen") / "merged"
    merge(split_run, split_run / COMPUTE_DIR, out)
    return out


class Recording:
    """A ``StepDecoder`` that keeps the logits it hands out."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.logits: list[torch.Tensor] = []

    def start(self, prompt):
        return self._keep(self.inner.start(prompt))

    def step(self, token):
        return self._keep(self.inner.step(token))

    def close(self) -> None:
        self.inner.close()

    def _keep(self, logits: torch.Tensor) -> torch.Tensor:
        self.logits.append(logits.detach().clone())
        return logits


def unsplit(merged_run, sampling: Sampling) -> tuple[list[int], list[torch.Tensor]]:
    model, _ = load_run_model(merged_run)
    model.eval()
    decoder = Recording(Decoder(model, len(PROMPT) + NEW))
    with torch.inference_mode():
        tokens = decode(decoder, PROMPT, NEW, sampling)
    # the recording changes nothing: generate() itself gives the same tokens
    assert tokens == generate(
        model,
        PROMPT,
        NEW,
        temperature=sampling.temperature,
        top_k=sampling.top_k,
        top_p=sampling.top_p,
        seed=sampling.seed,
    )
    return tokens, decoder.logits


def split(run, sampling: Sampling, **session) -> tuple[list[int], list]:
    with open_data_session(run, "cpu", purpose="generate", **session) as (s, _):
        decoder = Recording(s.decoder(len(PROMPT) + NEW))
        try:
            tokens = decode(decoder, PROMPT, NEW, sampling)
        finally:
            decoder.close()
    return tokens, decoder.logits


def assert_same(got, want) -> None:
    tokens, logits = got
    want_tokens, want_logits = want
    assert tokens == want_tokens
    assert len(logits) == len(want_logits) == NEW
    for step, (a, b) in enumerate(zip(logits, want_logits, strict=True)):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5, msg=f"step {step}")


@pytest.mark.parametrize("kind", list(SAMPLINGS))
def test_in_process_split_generation_equals_unsplit(split_run, merged, kind):
    # Execute
    want = unsplit(merged, SAMPLINGS[kind])
    got = split(split_run, SAMPLINGS[kind], mode="local")
    # Assert
    assert_same(got, want)


@pytest.mark.heavy
def test_grpc_split_generation_equals_unsplit(
    tmp_path, split_run, merged, split_config, token_file
):
    # Prepare: a real gRPC compute party serving the run's B half (loopback)
    settings = LinkSettings("127.0.0.1:0", token_file=str(token_file), insecure=True)
    # A --mode local run, its compute party now served over the network: its
    # operator lets the run's own data party in (the run names no identity).
    with start_server(
        split_config, split_run / COMPUTE_DIR, settings, accept_unbound=True
    ) as server:
        peer = LinkSettings(server.address, token_file=str(token_file), insecure=True)
        # Execute: both samplings in turn, one session each
        for sampling in SAMPLINGS.values():
            assert_same(
                split(split_run, sampling, peer=peer), unsplit(merged, sampling)
            )


def test_the_prompt_runs_once_and_one_position_crosses_per_token(split_run):
    """What crosses per generation step: the new positions' hidden states only."""
    seen: list[tuple[str, tuple[int, ...]]] = []
    with open_data_session(split_run, "cpu", purpose="generate") as (s, _):
        send = s.link.send

        def spy(tag, tensor, **kw):
            seen.append((tag, tuple(tensor.shape)))
            return send(tag, tensor, **kw)

        s.link.send = spy
        decoder = s.decoder(len(PROMPT) + 4)
        decode(decoder, PROMPT, 4, Sampling())
        decoder.close()
    hidden = 32
    acts = [shape for tag, shape in seen if tag == "act"]
    assert acts == [(1, len(PROMPT), hidden)] + [(1, 1, hidden)] * 3
    assert {tag for tag, _ in seen} == {"ctl", "act"}  # never a token id


def test_cli_split_generate_prints_what_aisyn_generate_prints(
    split_run, merged, capsys
):
    outs = []
    # 1e-300 rounds to 0 in float32: it picks the top token, as greedy does
    # (it ended in "probability tensor contains either inf, nan ...").
    tiny_t = ["--temperature", "1e-300", "--seed", "1"]
    for extra in ([], ["--temperature", "1.5", "--seed", "3"], tiny_t):
        args = ["--prompt", "今天天气", "--max-new-tokens", "8", "--device", "cpu"]
        assert main(["generate", "--run", str(merged), *args, *extra]) == 0
        plain = capsys.readouterr().out
        argv = ["split", "generate", "--run", str(split_run), "--mode", "local"]
        assert main([*argv, *args, *extra]) == 0
        through_link = capsys.readouterr().out
        assert through_link == plain
        outs.append(plain)
    assert outs[1].strip()  # sampled: text (a 3-step model's greedy may be <eod>)
    assert outs[2] == outs[0]


@pytest.mark.parametrize(
    "args,message",
    [
        (["--max-new-tokens", "40"], "exceeds the model's seq_len 32"),
        (["--top-p", "0"], "--top-p"),
        (["--temperature", "-1"], "--temperature"),
        (["--top-k", "x"], "--top-k"),
        (["--mode", "local", "--peer", "127.0.0.1:1"], "--peer needs --mode grpc"),
    ],
)
def test_cli_bad_input_is_one_line(split_run, capsys, args, message):
    argv = ["split", "generate", "--run", str(split_run), "--prompt", "今天"]
    try:
        status = main([*argv, "--device", "cpu", *args])
    except SystemExit as e:  # argparse's own exit, for a flag it parses
        status = e.code
    assert status != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert message in err[-1] and "Traceback" not in "\n".join(err)


def test_cli_refuses_runs_that_are_not_a_split_data_party(split_run, merged, capsys):
    argv = ["split", "generate", "--prompt", "今天", "--device", "cpu"]
    assert main([*argv, "--run", str(merged)]) != 0
    assert "not a split run's data party" in capsys.readouterr().err
    # and `aisyn generate` on a split run points here
    assert main(["generate", "--run", str(split_run), "--prompt", "今天"]) != 0
    assert "aisyn split generate" in capsys.readouterr().err


# --- the compute party checks every generation round ---------------------------


def ctl(op, step=0, m=1, mb=1, T=4, window=0, flags=0) -> torch.Tensor:
    return torch.tensor([op, step, m, mb, T, window, flags], dtype=torch.int64)


@pytest.mark.parametrize(
    "control,match",
    [
        (ctl(proto.GEN_START, T=0), "capacity 0 outside 1..32"),
        (ctl(proto.GEN_START, T=33), "capacity 33 outside 1..32"),
        (ctl(proto.GEN_START, mb=2), "one sequence"),
        (ctl(proto.GEN_START, flags=proto.FLAG_EOD), "one sequence"),
        (ctl(proto.GEN_STEP, step=30, T=3), r"positions \[30, 33\) outside"),
        (ctl(proto.GEN_STEP, T=0), "outside"),
        (ctl(proto.GEN_END, T=1), "carries no sizes"),
    ],
)
def test_bad_generation_controls_are_refused(split_config, control, match):
    with pytest.raises(proto.ProtocolError, match=match):
        proto.Control.parse(control, split_config.seq_len)


def b_session(run, purpose="generate"):
    """A's end of an in-process session with the run's compute party."""
    config = RunDir(run).read_config()
    cfg = config_from_dict(config["model"])
    hello = proto.hello(
        purpose=purpose,
        run_id=config["run_id"],
        model=cfg.to_dict(),
        partition=config["partition"],
        train=train_cfg(steps=3, ckpt_every=3),
        eval_step=3,
    )
    return open_local(
        cfg, parse_partition(CUT, cfg), run / COMPUTE_DIR, hello, codec="none",
        device="cpu",
    )  # fmt: skip


def act(n: int, value: float = 0.5) -> torch.Tensor:
    return torch.full((1, n, 32), value)


@pytest.mark.parametrize(
    "rounds,match",
    [
        ([(ctl(proto.GEN_STEP, T=2), act(2))], "GEN_STEP with no generation open"),
        ([(ctl(proto.GEN_END, T=0, m=0, mb=0), None)], "GEN_END with no generation"),
        (
            [(ctl(proto.GEN_START, T=8), None), (ctl(proto.GEN_START, T=8), None)],
            "while a generation is open",
        ),
        (
            [(ctl(proto.GEN_START, T=8), None), (ctl(proto.GEN_STEP, step=2), None)],
            r"positions \[2, 6\): the cache holds 0 of 8",
        ),
        (
            [(ctl(proto.GEN_START, T=4), None), (ctl(proto.GEN_STEP, T=5), None)],
            r"the cache holds 0 of 4",
        ),
        (
            [(ctl(proto.GEN_START, T=8), None), (ctl(proto.GEN_STEP), act(4, NAN))],
            "non-finite activations",
        ),
    ],
    ids=["no-start", "end-no-start", "twice", "wrong-position", "over-capacity", "nan"],
)
def test_compute_party_refuses_bad_generation_rounds(split_run, rounds, match):
    with pytest.raises((proto.ProtocolError, LinkError), match=match):
        with b_session(split_run) as opened:
            for r, (control, x) in enumerate(rounds):
                opened.link.send("ctl", control, step=r)
                if x is not None:
                    opened.link.send("act", x, step=r)
            opened.link.recv("out", step=len(rounds) - 1, shape=(1, 4, 32))


def test_generation_rounds_need_a_generate_session(split_run):
    with pytest.raises((proto.ProtocolError, LinkError), match="in a eval session"):
        with b_session(split_run, purpose="eval") as opened:
            opened.link.send("ctl", ctl(proto.GEN_START, T=8), step=0)
            opened.link.recv("out", step=0, shape=(1, 4, 32))


def test_a_generation_can_follow_another_in_one_session(split_run, merged):
    want = unsplit(merged, SAMPLINGS["greedy"])[0]
    with open_data_session(split_run, "cpu", purpose="generate") as (s, _):
        for _ in range(2):
            decoder = s.decoder(len(PROMPT) + NEW)
            assert decode(decoder, PROMPT, NEW, Sampling()) == want
            decoder.close()
