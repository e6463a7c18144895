"""The compute party's server against a data party that misbehaves on purpose
(issue 8, "The server"): a crafted hello, a client that goes quiet, control
errors, clients sharing a hello text, many short sessions, a bad reply. Each
case ends only its own session, says why in one line, and leaves the server
serving; the server holds no more than one session at a time."""

from __future__ import annotations

import gc
import logging
import threading
import time
import tracemalloc
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import CUT, TOKEN, ServerThread, start_server, train_cfg

from aisyn.link import (
    GrpcLinkServer,
    HandshakeError,
    LinkOptions,
    PeerAbortedError,
    PeerLostError,
    connect,
)
from aisyn.link.errors import FrameError, FrameOrderError
from aisyn.link.grpc_link import _ClientLink
from aisyn.link.grpc_server import _ServerLink
from aisyn.link.memory import MemoryLink, memory_pair
from aisyn.model.segments import COMPUTE_PARTY, init_seeds, parse_partition
from aisyn.split import protocol as proto
from aisyn.split.backbone.compute_party import Session
from aisyn.split.centre.server import SplitServer
from aisyn.split.session import SplitOptions, open_grpc, open_local
from aisyn.split.transport import (
    COMPUTE_PARTY_IDLE_TIMEOUT_S,
    DATA_PARTY_RECV_TIMEOUT_S,
    LinkSettings,
    link_options,
)

DEEP_JSON = "[" * 16000 + "]" * 16000  # fits the 32 KiB hello
CLIENT = LinkOptions(keepalive_s=0.5, keepalive_timeout_s=1.0, drop_unread=False)
IDLE_S = 1.5
LINK_TYPES = (_ClientLink, _ServerLink, MemoryLink)


def fresh_hello(cfg, run_id: str = "hardening") -> dict:
    """A data party's hello for a fresh run from random init, as split_train's."""
    partition = parse_partition(CUT, cfg)
    train = train_cfg(steps=4)
    return proto.hello(
        purpose="train",
        run_id=run_id,
        model=cfg.to_dict(),
        partition=partition.to_dict(),
        train=train,
        init_seeds=init_seeds(cfg, partition, COMPUTE_PARTY, train.seed),
    )


def bad_control() -> torch.Tensor:
    return proto.Control(9, 0).tensor()  # op 9 does not exist


def dial(address: str, session: str, timeout: float = 10):
    return connect(
        address,
        token=TOKEN,
        insecure=True,
        session=session,
        options=CLIENT,
        timeout=timeout,
    )


@pytest.fixture(scope="module")
def listen(tmp_path_factory) -> LinkSettings:
    token = tmp_path_factory.mktemp("token") / "token"
    token.write_text(TOKEN)
    return LinkSettings("127.0.0.1:0", token_file=str(token), insecure=True)


@pytest.fixture(scope="module")
def served(split_config, listen):
    """A real compute party (no --out) with a short idle timeout."""
    with start_server(split_config, None, listen, recv_timeout_s=IDLE_S) as server:
        yield server


def assert_serves(served, split_config) -> None:
    """A well-formed session still gets in (the slot is free) and is refused
    or accepted on its merits."""
    link = dial(served.address, proto.encode_json(fresh_hello(split_config)))
    link.close()


# --- 1. a hello that blows the JSON parser's stack ----------------------------


def test_deeply_nested_json_is_a_protocol_error():
    with pytest.raises(proto.ProtocolError, match="hello: not JSON"):
        proto.decode_json(DEEP_JSON, "hello")


def test_deeply_nested_hello_is_refused_and_frees_the_server(served, split_config):
    for _ in range(2):  # a leaked slot would turn the second away as "busy"
        with pytest.raises(HandshakeError, match="refused the session: hello: not"):
            dial(served.address, DEEP_JSON)
    assert_serves(served, split_config)


# --- 2. a data party that goes quiet, or answers under the wrong step ---------


@pytest.mark.heavy
def test_silent_data_party_loses_its_session_to_the_idle_timeout(served, split_config):
    link = dial(served.address, proto.encode_json(fresh_hello(split_config)))
    t0 = time.monotonic()
    with pytest.raises(
        PeerAbortedError,
        match=f"stopped waiting: .*timed out after {IDLE_S:g} s waiting for "
        "tensor 'ctl' step 0",
    ):
        link.recv("out", step=0, timeout=60)
    assert time.monotonic() - t0 < IDLE_S + 10
    link.close()
    assert_serves(served, split_config)


def test_both_parties_wait_bounded_by_default(listen):
    assert SplitOptions().recv_timeout_s == DATA_PARTY_RECV_TIMEOUT_S
    assert link_options().recv_timeout_s == DATA_PARTY_RECV_TIMEOUT_S
    assert DATA_PARTY_RECV_TIMEOUT_S >= 600 and COMPUTE_PARTY_IDLE_TIMEOUT_S >= 600
    server = SplitServer(FakeParty(), listen)
    assert server.server._opts.recv_timeout_s == COMPUTE_PARTY_IDLE_TIMEOUT_S
    assert server.server._opts.drop_unread is False
    server.stop()


def test_timeout_flags(tmp_path):
    from aisyn.cli import build_parser

    parse = build_parser().parse_args
    serve = ["split", "serve", "--listen", "127.0.0.1:0", "--model", "tiny"]
    serve += ["--cut", CUT]
    assert parse(serve).idle_timeout == COMPUTE_PARTY_IDLE_TIMEOUT_S
    assert parse([*serve, "--idle-timeout", "90"]).idle_timeout == 90.0
    assert parse([*serve, "--idle-timeout", "none"]).idle_timeout is None
    train = ["split", "train", "--data", str(tmp_path), "--out", str(tmp_path / "r")]
    assert parse(train).recv_timeout == DATA_PARTY_RECV_TIMEOUT_S
    assert parse([*train, "--recv-timeout", "0"]).recv_timeout is None
    with pytest.raises(SystemExit):
        parse([*serve, "--idle-timeout", "-5"])


def test_an_answer_under_the_wrong_step_fails_the_data_party_at_once():
    """B answers round 0 under step 1: A, whose link has no timeout here, is
    told at once instead of waiting forever."""
    a, b = memory_pair(options=link_options(recv_timeout_s=None))
    a.send("ctl", proto.Control(proto.EVAL, 0, 1, 2, 16).tensor(), step=0)
    b.recv("ctl", step=0, timeout=5)
    b.send("out", torch.zeros(2, 16, 32), step=1)
    with pytest.raises(FrameOrderError, match="'out' step 0 micro 0 never came"):
        a.recv("out", step=0, shape=(2, 16, 32))
    a.close()
    b.close()


# --- 3. control errors reach the data party with B's reason -------------------


def test_protocol_error_in_a_round_reaches_the_data_party(served, split_config):
    link = dial(served.address, proto.encode_json(fresh_hello(split_config)))
    link.send("ctl", bad_control(), step=0)
    with pytest.raises(PeerAbortedError, match="aborted the session: control: unknown"):
        link.recv("out", step=0, timeout=30)
    link.close()
    assert_serves(served, split_config)


def test_protocol_error_in_a_round_reaches_the_data_party_in_process(
    tmp_path, split_config
):
    partition = parse_partition(CUT, split_config)
    hello = fresh_hello(split_config)
    with open_local(
        split_config, partition, tmp_path / "b", hello, codec="none", device="cpu"
    ) as opened:
        opened.link.send("ctl", bad_control(), step=0)
        with pytest.raises(
            PeerAbortedError, match="peer aborted the session: control: unknown op 9"
        ):
            opened.link.recv("out", step=0, timeout=30)


class FakeParty:
    """Stands in for ComputeParty where the server's session handling, not
    the model, is under test. The hello's ``purpose`` picks the behaviour."""

    cfg = SimpleNamespace(to_dict=lambda: {"model": "fake"})
    partition = SimpleNamespace(describe=lambda: "fake cut")

    def __init__(self, slow_s: float = 0.0) -> None:
        self.serial = 0
        self.served: list[int] = []
        self.slow_s = slow_s
        self.max_server_link_threads = 0
        # Another test's leftovers are not this server's sessions.
        self._threads_before = set(threading.enumerate())

    ranks = None  # one process

    def negotiate(
        self, hello_text: str, identity: str, tenant: str = ""
    ) -> tuple[str, Session]:
        try:
            h = proto.decode_json(hello_text, "hello")
        except proto.ProtocolError as e:  # as ComputeParty.negotiate does
            raise HandshakeError(f"compute party refused the session: {e}") from None
        if h["purpose"] == "refuse":
            raise HandshakeError("compute party refused the session: test refusal")
        self.serial += 1
        reply = proto.encode_json(proto.reply(0, []))
        return reply, Session(h["purpose"], f"run{self.serial}", None, 0)

    def serve_session(self, link, session: Session, **timeouts) -> None:
        self._count_server_links()
        self.served.append(int(session.run_id.removeprefix("run")))
        time.sleep(self.slow_s)
        self._count_server_links()
        if session.purpose == "bug":
            raise RuntimeError("/srv/secret/path exploded")
        if session.purpose == "protocol":
            raise proto.ProtocolError("control: unknown op 9")
        try:
            link.send("out", link.recv("ctl", step=0, timeout=10), step=0)
            link.recv("ctl", step=1, timeout=10)
        except PeerLostError:
            return

    def _count_server_links(self) -> None:
        """Server-side links alive now (each has a send and a receive thread)."""
        threads = sum(
            t.name.startswith("link[B<-") and t not in self._threads_before
            for t in threading.enumerate()
        )
        self.max_server_link_threads = max(self.max_server_link_threads, threads)


def fake_hello(purpose: str) -> str:
    return proto.encode_json({"protocol": proto.PROTOCOL, "purpose": purpose})


def test_a_bug_in_the_compute_party_is_reported_without_its_internals(listen):
    with ServerThread(SplitServer(FakeParty(), listen)) as server:
        link = dial(server.address, fake_hello("bug"))
        with pytest.raises(PeerAbortedError, match="internal error") as info:
            link.recv("out", step=0, timeout=30)
        assert "secret" not in str(info.value)
        link.close()


# --- 4. sessions with the same hello text ---------------------------------------


@pytest.mark.heavy
def test_sessions_with_the_same_hello_each_keep_their_own_terms(listen):
    party = FakeParty()
    server = SplitServer(party, listen).start()
    try:
        first = dial(server.address, fake_hello("train"))
        first._channel.close()  # gone at once, before B took the session
        first.close()
        second: list = []
        client = threading.Thread(
            target=lambda: second.append(dial(server.address, fake_hello("train"))),
            daemon=True,
        )
        client.start()
        deadline = time.monotonic() + 1.0  # time for a second handshake, if allowed
        while party.serial < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert server.serve_one(timeout=5)  # the first client's session
        client.join(15)
        second[0].close()
        assert server.serve_one(timeout=5)  # then the second's
        assert party.served == [1, 2]
    finally:
        server.stop()


# --- 5. many short sessions leave nothing behind ----------------------------------


def one_session(address: str, kind: str) -> None:
    if kind == "deep":
        with pytest.raises(HandshakeError, match="not JSON"):
            dial(address, DEEP_JSON)
        return
    if kind == "refuse":
        with pytest.raises(HandshakeError, match="test refusal"):
            dial(address, fake_hello("refuse"))
        return
    link = dial(address, fake_hello("protocol" if kind == "protocol" else "train"))
    try:
        if kind == "drop":  # vanish without a goodbye
            link._channel.close()
        elif kind == "protocol":
            with pytest.raises(PeerAbortedError, match="unknown op 9"):
                link.recv("out", step=0, timeout=30)
        else:
            link.send("ctl", torch.ones(7, dtype=torch.int64), step=0)
            link.recv("out", step=0, timeout=30)
    finally:
        link.close()


def aisyn_bytes(snapshot: tracemalloc.Snapshot) -> int:
    src = str(Path(proto.__file__).parents[1])  # .../aisyn
    return sum(
        stat.size
        for stat in snapshot.statistics("filename")
        if stat.traceback[0].filename.startswith(src)
    )


@pytest.mark.heavy
def test_many_short_sessions_leave_nothing_behind(listen, caplog):
    """140 sessions of every kind, clients faster than the server: the server
    holds one session at a time, and the project's own memory, links and
    threads do not grow with the number of sessions."""
    kinds = ["drop", "drop", "ok", "drop", "protocol", "refuse", "deep"]
    reach_b = sum(kind in ("ok", "drop", "protocol") for kind in kinds)
    party = FakeParty(slow_s=0.05)  # slower than its clients
    gc.collect()  # links another test left behind are not this test's
    links_before = {id(o) for o in gc.get_objects() if type(o) in LINK_TYPES}
    # pytest keeps every log record of a test, and a record its exception's
    # frames: measure the server, not that.
    caplog.set_level(logging.CRITICAL, logger="aisyn")

    def run(n: int) -> int:
        served = server.server.sessions_served
        for i in range(n):
            one_session(server.address, kinds[i % len(kinds)])
        deadline = time.monotonic() + 10
        while server.server.sessions_served < served + n // len(kinds) * reach_b:
            assert time.monotonic() < deadline, "the server fell behind"
            time.sleep(0.05)
        gc.collect()
        return aisyn_bytes(tracemalloc.take_snapshot())

    tracemalloc.start()
    try:
        with ServerThread(SplitServer(party, listen)) as server:
            before = run(2 * len(kinds))  # warm up every path
            after = run(20 * len(kinds))
    finally:
        tracemalloc.stop()
    assert party.max_server_link_threads <= 2, "sessions piled up behind one"
    assert after - before < 32 * 1024, f"aisyn memory grew by {after - before} B"
    gc.collect()
    assert not [
        o
        for o in gc.get_objects()
        if type(o) in LINK_TYPES and id(o) not in links_before
    ]
    assert not [
        t
        for t in threading.enumerate()
        if t.name.startswith("link[") and t not in party._threads_before
    ]


# --- 6. a reply the data party cannot act on -----------------------------------


@pytest.mark.parametrize(
    "reply,problem",
    [
        ({"b_steps": []}, "start_step None is not a step"),
        ({"start_step": "3", "b_steps": []}, "start_step '3' is not a step"),
        ({"start_step": 2.0, "b_steps": []}, "start_step 2.0 is not a step"),
        ({"start_step": True, "b_steps": []}, "start_step True is not a step"),
        ({"start_step": -1, "b_steps": []}, "start_step -1 is not a step"),
        ({"start_step": 0}, "b_steps must be a list of steps"),
        ({"start_step": 0, "b_steps": [2, "4"]}, "b_steps must be a list of steps"),
    ],
)
def test_a_bad_reply_is_refused_in_one_line(reply, problem):
    text = proto.encode_json({"protocol": proto.PROTOCOL, **reply})
    with pytest.raises(proto.ProtocolError, match=f"compute party's reply: {problem}"):
        proto.parse_reply(text)


def test_a_good_reply_is_accepted():
    text = proto.encode_json(proto.reply(4, [2, 4]))
    assert proto.parse_reply(text)["start_step"] == 4


def test_a_bad_reply_ends_the_session_and_b_learns_why(listen):
    bad = proto.encode_json({"protocol": proto.PROTOCOL, "b_steps": []})
    with GrpcLinkServer(
        "127.0.0.1:0", token=TOKEN, insecure=True, session=bad, options=CLIENT
    ) as srv:
        peer = LinkSettings(srv.address, token_file=listen.token_file, insecure=True)
        with pytest.raises(proto.ProtocolError, match="start_step None"):
            with open_grpc(peer, {"protocol": proto.PROTOCOL}, codec="none"):
                pass
        b = srv.accept(timeout=5)
        with pytest.raises(FrameError, match="data party refused the reply"):
            b.recv("ctl", step=0, timeout=10)
        b.close()
