"""The link between the two parties of split training.

Party A (data party: embedding + LM head) and party B (compute party:
transformer backbone) exchange only cut-layer activations, their gradients,
and a few scalars (e.g. each side's squared gradient norm for global
clipping). This package is that channel::

    link.send("act", hidden, step=s, micro=m)           # non-blocking
    grad = link.recv("grad", step=s, micro=m, shape=hidden.shape,
                     dtype=hidden.dtype, timeout=60)    # matched by key
    link.send_scalar("gnorm2", local_sq_norm, step=s)
    total = local_sq_norm + link.recv_scalar("gnorm2", step=s, timeout=60)

Implementations: :func:`memory_pair` (in-process; zero-copy with codec
"none") and the gRPC pair :class:`GrpcLinkServer` (party B) /
:func:`connect` (party A)::

    # B                                        # A
    server = GrpcLinkServer(                   link = connect(
        "0.0.0.0:50051", token=tok,                "b.example.org:50051",
        tls=TlsConfig.from_files(...),             token=tok, tls=...,
        session=check_client_hello,                session=json.dumps(cfg),
    ).start()                                      timeout=60)
    link = server.accept(timeout=600)          reply = link.peer.session

Design
------
*One bidirectional stream per session.* Both directions share one HTTP/2
stream, so frames in each direction stay in the order they were sent (which
makes the ordering rules checkable), there is one connection to secure,
authenticate and keep alive, and a dead peer takes the whole session down at
once instead of leaving one half hanging. Frames carry (tag, step, micro) so
``recv`` can match by key with several micro-batches in flight.

*A bulk data plane beside the stream* (``data_plane.py``, opt-in on the
server with ``data_listen``): gRPC costs about a millisecond per message and
moves half of what one TLS socket does, so a server may offer each session,
in its HELLO, a port and a one-time secret; the client opens two mutual-TLS
connections there (one per direction, the same certificate as the stream)
and every later frame travels on them in order, received straight into the
destination tensor, while the gRPC stream stays as the control stream
(keepalive, and the reason when a side breaks off).

*Chunking at 4 MiB.* gRPC's default message limit is 4 MiB and proxies on the
way are tuned for it; bounded messages also bound what one frame can make
either side allocate, and let the sender interleave encoding with
transmission. Every chunk repeats the tensor header so each is validated on
its own; the data bytes are written straight from tensor memory.

*Validation at the edge.* Everything the peer sends is untrusted: frames are
parsed and checked (sizes, dtype, shape vs. byte count, chunk order, step
monotonicity, duplicate keys, memory budget) before any buffer is allocated
or any tensor reaches training code, and ``recv`` checks the shape/dtype the
caller expects. A violation raises a :class:`FrameError` subclass with a
one-line reason on this side, ends the session with that reason on the other
side, and leaves a server ready for the next session. Nothing is ever
unpickled: tensors travel as raw bytes plus a dtype name.

Security: mutual TLS (:class:`TlsConfig`, :func:`make_dev_certs` for tests) plus
a shared bearer token compared in constant time. Plaintext needs
``insecure=True`` and is refused off loopback unless
``allow_insecure_remote=True``.

A lost peer is detected by gRPC keepalive pings within about
``keepalive_s + keepalive_timeout_s`` (3 s by default) and surfaces as
:class:`PeerLostError` from every pending and later call.

Performance: on gRPC a tensor is copied once on each side outside gRPC (into
the outgoing frame, into the received tensor); on the data plane it is sent
from its own memory and received into its destination. int8 quantisation
costs CPU time on both ends (see the benchmark). Every received tensor is the
caller's own; the buffers of those it has dropped are reused for the next of
the same size (``assembly.ReceivePool``), since a fresh multi-MiB buffer's pages
fault in as the data lands.
"""

from .base import MAX_CHUNK_BYTES, Link, LinkOptions, PeerHello
from .certs import DevCerts, TlsConfig, make_dev_certs
from .codec import CODECS
from .data_plane import certificate_identity
from .errors import (
    AuthError,
    CertificateError,
    FrameError,
    FrameMismatchError,
    FrameOrderError,
    FrameTooLargeError,
    HandshakeError,
    LinkClosedError,
    LinkError,
    LinkTimeoutError,
    MalformedFrameError,
    PeerAbortedError,
    PeerClosedError,
    PeerLostError,
    SessionAbortedError,
)
from .grpc_link import GrpcLink, connect
from .grpc_server import (
    Accept,
    GrpcLinkServer,
    certificate_subject,
    token_identity,
)
from .memory import memory_pair
from .shaper import ShapedProxy

__all__ = [
    "CODECS",
    "MAX_CHUNK_BYTES",
    "Accept",
    "AuthError",
    "CertificateError",
    "DevCerts",
    "FrameError",
    "FrameMismatchError",
    "FrameOrderError",
    "FrameTooLargeError",
    "GrpcLink",
    "GrpcLinkServer",
    "HandshakeError",
    "Link",
    "LinkClosedError",
    "LinkError",
    "LinkOptions",
    "LinkTimeoutError",
    "MalformedFrameError",
    "PeerAbortedError",
    "PeerClosedError",
    "PeerHello",
    "PeerLostError",
    "SessionAbortedError",
    "ShapedProxy",
    "TlsConfig",
    "certificate_identity",
    "certificate_subject",
    "connect",
    "make_dev_certs",
    "memory_pair",
    "token_identity",
]
