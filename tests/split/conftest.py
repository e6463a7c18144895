"""Fixtures for split training: a model with a real middle, a baseline run,
an in-process gRPC compute party, dev certificates, a hang watchdog."""

from __future__ import annotations

import faulthandler
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from aisyn.model.pangu import PanguConfig
from aisyn.train.config import TrainConfig
from aisyn.train.pretrain import train
from aisyn.train.run import read_metrics

TOKEN = "split-test-token"


@pytest.fixture(autouse=True)
def _watchdog() -> Iterator[None]:
    """Dump all stacks and exit if a test hangs, so the suite always ends."""
    faulthandler.dump_traceback_later(240, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()


@pytest.fixture(scope="session")
def split_config() -> PanguConfig:
    """Five layers: with cut u:1,1 each party runs real blocks (A: embedding +
    h0 and h2 + top query h4 + head; B: h1, h2... see CUT)."""
    return PanguConfig(
        vocab_size=8000,
        hidden_size=32,
        num_layers=5,
        num_heads=4,
        ffn_size=64,
        seq_len=32,
    )


CUT = "u:1,1"  # A: embedding + h[0] | B: h[1:3] | A: h[3] + top query h[4] + head


def train_cfg(**overrides) -> TrainConfig:
    base = dict(
        steps=20,
        batch_size=8,
        micro_batch_size=2,
        lr=3e-3,
        warmup_steps=4,
        log_every=1,
        seed=11,
        device="cpu",
    )
    return TrainConfig(**{**base, **overrides})


def losses(run: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(Path(run) / "metrics.jsonl") if "loss" in r]


@pytest.fixture(scope="session")
def baseline(tmp_path_factory, news_data, split_config) -> list[float]:
    """Per-step losses of plain ``aisyn train`` (20 steps, 4 micro-batches)."""
    out = tmp_path_factory.mktemp("baseline") / "run"
    train(split_config, [news_data], out, train_cfg(), progress=False)
    return losses(out)


@pytest.fixture(scope="session")
def ft_config() -> PanguConfig:
    """The split tests' five-layer model, with room for 64-token SFT items."""
    return PanguConfig(
        vocab_size=8000,
        hidden_size=32,
        num_layers=5,
        num_heads=4,
        ffn_size=64,
        seq_len=64,
    )


@pytest.fixture(scope="session")
def ft_base(tmp_path_factory, news_data, ft_config) -> Path:
    """The pre-trained base: a 2-step ``aisyn train`` run on news shards."""
    out = tmp_path_factory.mktemp("ft_base") / "run"
    train(ft_config, [news_data], out, train_cfg(steps=2, seed=5), progress=False)
    return out


@pytest.fixture(scope="session")
def ft_sft_dir(tmp_path_factory, tokenizer) -> Path:
    """Cloze items of 400 news paragraphs cut to 10-59 characters, so that
    items differ in length and batches in their padded length."""
    from aisyn.data.corpora import load_corpus
    from aisyn.data.sft import prepare_sft

    root = tmp_path_factory.mktemp("ft_sft")
    docs = [d.text.replace("\n", " ") for d in load_corpus("news").documents[:400]]
    corpus = root / "news.txt"
    corpus.write_text(
        "".join(d[: 10 + (i * 13) % 50] + "\n" for i, d in enumerate(docs)),
        encoding="utf-8",
    )
    out = root / "sft"
    prepare_sft(load_corpus(corpus), tokenizer, 64, out, per_document=2)
    return out


@pytest.fixture(scope="session")
def token_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("token") / "token"
    path.write_text(TOKEN + "\n")
    return path


@pytest.fixture(scope="session")
def certs(tmp_path_factory):
    from aisyn.link.certs import make_dev_certs

    return make_dev_certs(tmp_path_factory.mktemp("certs"))


class ServerThread:
    """A real gRPC compute party, serving sessions on a background thread
    (each on a thread of its own with ``concurrent``)."""

    def __init__(self, server, concurrent: bool = False) -> None:
        self.server = server
        self.concurrent = concurrent
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        from aisyn.link.errors import LinkTimeoutError

        serve = (
            self.server.serve_in_background
            if self.concurrent
            else self.server.serve_one
        )
        while not self.stopped.is_set():
            try:
                serve(timeout=0.2)
            except LinkTimeoutError:
                continue

    @property
    def address(self) -> str:
        return self.server.address

    def __enter__(self) -> ServerThread:
        self.server.start()
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stopped.set()
        self.thread.join(10)
        self.server.join(30)  # the sessions running in the background
        self.server.stop()


def start_server(
    cfg: PanguConfig,
    root: Path,
    settings,
    cut: str = CUT,
    init_from: Path | None = None,
    accept_unbound: bool = False,
    **options,
) -> ServerThread:
    from aisyn.link.base import LinkOptions
    from aisyn.model.segments import parse_partition
    from aisyn.split.backbone.compute_party import ComputeParty
    from aisyn.split.centre.server import SplitServer

    party = ComputeParty(
        cfg,
        parse_partition(cut, cfg),
        root,
        device="cpu",
        init_from=init_from,
        accept_unbound=accept_unbound,
    )
    opts = LinkOptions(keepalive_s=0.5, keepalive_timeout_s=1.0, **options)
    return ServerThread(SplitServer(party, settings, opts))


def server_settings(certs, token_file: Path):
    """What a compute party listens with on loopback: mTLS from ``certs``
    (``make_dev_certs``) and the token in ``token_file``."""
    from aisyn.split.transport import LinkSettings

    return LinkSettings(
        "127.0.0.1:0",
        tls_cert=str(certs.server_cert),
        tls_key=str(certs.server_key),
        tls_ca=str(certs.ca_cert),
        token_file=str(token_file),
    )
