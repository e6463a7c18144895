"""The compute party's server under attack or misuse: every bad session is
refused or ended with a clear reason, the server keeps serving, and what it
has on disk is untouched. Runs over mutual TLS on loopback with generated
certificates."""

from __future__ import annotations

import dataclasses
import hashlib
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch
from conftest import CUT, TOKEN, start_server, train_cfg

from aisyn.link.base import LinkOptions
from aisyn.link.codec import encode
from aisyn.link.errors import (
    AuthError,
    FrameError,
    HandshakeError,
    PeerLostError,
)
from aisyn.link.frames import SCALAR, TENSOR, FrameKey, scalar_frame, tensor_frames
from aisyn.link.grpc_link import connect
from aisyn.link.proto import tensor_link_pb2 as pb
from aisyn.split import protocol as proto
from aisyn.split.client.evaluate import open_split_model
from aisyn.split.client.train import split_train
from aisyn.split.session import SplitOptions
from aisyn.split.transport import LinkSettings
from aisyn.train.config import TrainConfig
from aisyn.train.run import RunDir

METHOD = "/aisyn.link.v1.TensorLink/Exchange"


@dataclasses.dataclass
class Served:
    server: object
    a_run: Path
    b_root: Path
    client: LinkSettings
    certs: object
    hello: dict


def snapshot(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


@pytest.fixture(scope="module")
def served(tmp_path_factory, news_data, split_config, certs) -> Iterator[Served]:
    """A TLS compute party that already holds a 2-step checkpoint of one run."""
    tmp = tmp_path_factory.mktemp("served")
    token = tmp / "token"
    token.write_text(TOKEN)
    listen = LinkSettings(
        "127.0.0.1:0",
        tls_cert=str(certs.server_cert),
        tls_key=str(certs.server_key),
        tls_ca=str(certs.ca_cert),
        token_file=str(token),
    )
    with start_server(
        split_config, tmp / "b", listen, max_tensor_bytes=1 << 20
    ) as server:
        client = dataclasses.replace(
            listen,
            address=server.address,
            tls_cert=str(certs.client_cert),
            tls_key=str(certs.client_key),
        )
        a_run = tmp / "a"
        split_train(
            split_config,
            [news_data],
            a_run,
            train_cfg(steps=2),
            SplitOptions(cut=CUT, mode="grpc", peer=client),
            progress=False,
        )
        config = RunDir(a_run).read_config()
        hello = proto.hello(
            purpose="train",
            run_id=config["run_id"],
            model=config["model"],
            partition=config["partition"],
            train=TrainConfig.from_dict(config["train"]),
            resume=True,
            a_steps=[2],
        )
        yield Served(server, a_run, tmp / "b", client, certs, hello)


def assert_still_serving_untouched(served: Served, before: dict[str, str]) -> None:
    """A good session still works and nothing on B's disk changed."""
    with open_split_model(served.a_run, "cpu", peer=served.client) as model:
        tokens = torch.randint(0, 8000, (2, 16))
        h = model.hidden(tokens)
    assert h.shape == (2, 16, 32) and torch.isfinite(h).all()
    assert snapshot(served.b_root) == before


def open_as_a(served: Served, hello: dict | None = None, **kw):
    return connect(
        served.client.address,
        token=TOKEN,
        tls=served.client.tls(),
        session=proto.encode_json(hello or served.hello),
        options=LinkOptions(keepalive_s=0.5, keepalive_timeout_s=1.0),
        timeout=kw.pop("timeout", 10),
        **kw,
    )


def test_tls_session_trained_and_checkpointed(served):
    ckpts = list((served.b_root).glob("*/checkpoints/step_00000002/model.safetensors"))
    assert len(ckpts) == 1
    assert_still_serving_untouched(served, snapshot(served.b_root))


def test_wrong_token_is_refused(served):
    before = snapshot(served.b_root)
    with pytest.raises(AuthError, match="invalid token"):
        connect(
            served.client.address,
            token="not-the-token",
            tls=served.client.tls(),
            session=proto.encode_json(served.hello),
            timeout=5,
        )
    assert_still_serving_untouched(served, before)


def test_client_without_certificate_is_refused(served):
    before = snapshot(served.b_root)
    creds = grpc.ssl_channel_credentials(
        root_certificates=served.certs.ca_cert.read_bytes()
    )
    hello = pb.Frame(
        hello=pb.Hello(
            role="A", protocol_version=1, session=proto.encode_json(served.hello)
        )
    )
    with grpc.secure_channel(served.client.address, creds) as channel:
        call = channel.stream_stream(
            METHOD,
            request_serializer=pb.Frame.SerializeToString,
            response_deserializer=pb.Frame.FromString,
        )(iter([hello]), metadata=[("authorization", f"Bearer {TOKEN}")], timeout=5)
        with pytest.raises(grpc.RpcError) as info:
            list(call)
    assert info.value.code() is grpc.StatusCode.UNAVAILABLE  # TLS handshake failed
    assert_still_serving_untouched(served, before)


@pytest.mark.parametrize(
    "change,match",
    [
        ({"model": {"hidden_size": 64}}, "model config differs"),
        # the parties must compute the same function, not just hold the shapes
        ({"model": {"activation": "fast_gelu"}}, r"differs .* in \['activation'\]"),
        ({"partition": {"num_layers": 5, "front": 2, "back": 0}}, "cut"),
        ({"run_id": "../../etc"}, "run id"),
        ({"protocol": "other/9"}, "protocol"),
        ({"purpose": "steal"}, "unknown purpose"),
        ({"a_steps": [7]}, "no checkpoint step both parties have"),
        ({"resume": False}, "already has checkpoints"),
        ({"train": {"lr": -1}}, "lr must be positive"),
        ({"backbone": "melted"}, "unknown backbone"),
        ({"backbone": float("nan")}, "unknown backbone"),
        # a frozen backbone needs a base, and this compute party has none
        ({"backbone": "frozen"}, "frozen backbone runs the base"),
    ],
)
def test_bad_hello_is_refused_with_the_reason(served, change, match):
    before = snapshot(served.b_root)
    hello = {**served.hello}
    for key, value in change.items():
        if isinstance(value, dict) and isinstance(hello.get(key), dict):
            value = {**hello[key], **value}
        hello[key] = value
    with pytest.raises(HandshakeError, match=match):
        open_as_a(served, hello)
    assert_still_serving_untouched(served, before)


def ctl(op=proto.TRAIN, step=2, m=1, mb=2, T=16, window=0, flags=0) -> torch.Tensor:
    return proto.Control(op, step, m, mb, T, window, flags).tensor()


@pytest.mark.parametrize(
    "case",
    ["act_wrong_shape", "act_wrong_dtype", "gout_wrong_shape", "ctl_wrong_shape"],
)
def test_wrong_tensor_ends_only_that_session(served, case):
    before = snapshot(served.b_root)
    link = open_as_a(served)
    x = torch.randn(2, 16, 32)
    if case == "ctl_wrong_shape":
        link.send("ctl", torch.zeros(3, dtype=torch.int64), step=0)
    else:
        link.send("ctl", ctl(), step=0)
        if case == "act_wrong_shape":
            link.send("act", torch.randn(2, 16, 31), step=0)
        elif case == "act_wrong_dtype":
            link.send("act", x.double(), step=0)
        else:
            link.send("act", x, step=0)
            link.recv("out", step=0, shape=x.shape, timeout=10)
            link.send("gout", torch.randn(2, 15, 32), step=0)
    with pytest.raises(FrameError, match="rejected the session: .*expected"):
        link.recv("never", step=0, timeout=10)
    link.close()
    assert_still_serving_untouched(served, before)


@pytest.mark.parametrize(
    "control",
    [
        ctl(op=9),
        ctl(step=5),  # B is at step 2
        ctl(m=0),
        ctl(T=33),  # longer than the model's 32 positions
        ctl(window=1000),
        ctl(op=proto.SAVE, step=7),
    ],
    ids=["unknown_op", "wrong_step", "no_micro", "too_long", "window", "save_step"],
)
def test_bad_control_ends_only_that_session(served, control):
    before = snapshot(served.b_root)
    link = open_as_a(served)
    link.send("ctl", control, step=0)
    with pytest.raises(PeerLostError):
        link.recv("out", step=0, timeout=10)
    link.close()
    assert_still_serving_untouched(served, before)


class RawSession:
    """Hand-made frames over a real mTLS call, as a broken client would send."""

    def __init__(self, served: Served, frames: list[bytes]) -> None:
        tls = served.client.tls()
        creds = grpc.ssl_channel_credentials(
            root_certificates=tls.root_ca,
            private_key=tls.private_key,
            certificate_chain=tls.cert_chain,
        )
        self._channel = grpc.secure_channel(served.client.address, creds)
        self._hold = threading.Event()
        hello = pb.Frame(
            hello=pb.Hello(
                role="A", protocol_version=1, session=proto.encode_json(served.hello)
            )
        ).SerializeToString()
        call = self._channel.stream_stream(
            METHOD,
            request_serializer=lambda b: b,
            response_deserializer=pb.Frame.FromString,
        )
        self._call = call(
            self._requests([hello, *frames]),
            metadata=[("authorization", f"Bearer {TOKEN}")],
            timeout=15,
        )

    def _requests(self, frames: list[bytes]) -> Iterator[bytes]:
        yield from frames
        self._hold.wait(15)  # keep our half open: the server must end the call

    def outcome(self) -> tuple[grpc.StatusCode, str]:
        try:
            for _ in self._call:
                pass
        except grpc.RpcError as exc:
            return exc.code(), exc.details()
        finally:
            self._hold.set()
            self._channel.close()
        return grpc.StatusCode.OK, ""


def raw_outcome(served: Served, frames: list[bytes]) -> tuple[grpc.StatusCode, str]:
    """``RawSession``'s outcome once the server takes it: the compute party
    serves one session at a time, and on a loaded box the previous case's
    session may still be ending (the server then answers "busy ... queued")."""
    deadline = time.monotonic() + 30
    while True:
        code, details = RawSession(served, frames).outcome()
        busy = code is grpc.StatusCode.UNAVAILABLE and "busy" in (details or "")
        if not busy or time.monotonic() > deadline:
            return code, details
        time.sleep(0.2)


def chunks(x: torch.Tensor, tag: str, step: int, chunk: int) -> list[bytes]:
    return list(tensor_frames(FrameKey(TENSOR, tag, step, 0), encode(x), chunk))


CTL1 = chunks(ctl(), "ctl", 1, 1 << 20)[0]


@pytest.mark.parametrize(
    "frames,message",
    [
        ([b"\x0a\xff\xff"], "undecodable"),
        (chunks(torch.randn(2, 16, 32), "act", 0, 1024)[:2], "truncated"),
        # Two checks see this peer's fault, and whichever runs first names it:
        # the frame reader (a step that decreases) or the compute party waiting
        # for step 0's control (the peer went on to step 1).
        (
            [CTL1, scalar_frame(FrameKey(SCALAR, "s", 0, 0), 1.0)],
            ("must not decrease", "the peer went on to step 1"),
        ),
        (chunks(torch.zeros(600, 1024), "act", 0, 1 << 20)[:1], "tensor limit"),
    ],
    ids=["malformed", "truncated", "out_of_order", "oversized"],
)
def test_bad_frames_are_rejected(served, frames, message):
    before = snapshot(served.b_root)
    if message == "truncated":  # a tensor cut short by another frame
        frames = [*frames, scalar_frame(FrameKey(SCALAR, "s", 0, 0), 1.0)]
    code, details = raw_outcome(served, frames)
    messages = message if isinstance(message, tuple) else (message,)
    assert code is grpc.StatusCode.INVALID_ARGUMENT and any(
        m in details for m in messages
    ), (
        code,
        details,
    )
    assert_still_serving_untouched(served, before)
