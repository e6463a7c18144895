"""The link from a GPU: device->host copies staged through pinned buffers, each
overlapped with the send of the chunk before (``link/staging.py``).

Run on a machine with a CUDA device. In one run, on tensors of the cut's size
(``--shape``, default 42 MB of fp32):

* rates of moving the tensor's bytes once: host memcpy (pageable to
  pageable), device->host with ``.cpu()`` (pageable), into one pinned buffer,
  and the link's staging alone (chunk copies into its three pinned buffers);
  host->device from pageable and from pinned memory (the receiving side, which
  still lands tensors in pageable memory: whether pinning them pays);
* exactness: GPU tensors sent through the link with its data plane (codecs
  none, bf16, int8) arrive as the same tensors sent from the host do;
* the link with its data plane on loopback mutual TLS, party B in a process of
  its own: a host tensor, a GPU tensor as it is (staged), and the same GPU
  tensor copied whole with ``.cpu()`` before each send (the path before
  staging).

The last line is for scripts::

    gpu: link from the GPU NN % of a host tensor's rate (.cpu() first NN %); \
D2H staged N.N GB/s, pinned N.N GB/s, pageable N.N GB/s; host memcpy N.N GB/s

    python bench/link_gpu.py                 # the device check (about a minute)
    python bench/link_gpu.py --device cpu    # the same plumbing without a GPU
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from link_throughput import TIMEOUT, TOKEN, Plan, start_peer, stop_peer  # noqa: E402

from aisyn.link import (  # noqa: E402
    DevCerts,
    GrpcLinkServer,
    Link,
    connect,
    make_dev_certs,
)
from aisyn.link.codec import decode, encode  # noqa: E402
from aisyn.link.staging import CudaCopier, HostStaging  # noqa: E402

GB = 1e9


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def rate_of(
    fn: Callable[[], None], nbytes: int, device: torch.device, reps: int
) -> float:
    """Median GB/s of ``fn`` moving ``nbytes`` (after one warm-up call)."""
    fn()
    _sync(device)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return nbytes / statistics.median(times) / GB


def copy_rates(x: torch.Tensor, reps: int) -> dict[str, float]:
    nbytes = x.numel() * x.element_size()
    host_src = x.cpu()
    host_dst = torch.empty_like(host_src)
    rates = {
        "host memcpy": rate_of(lambda: host_dst.copy_(host_src), nbytes, x.device, reps)
    }
    rates["pageable"] = rate_of(lambda: x.cpu(), nbytes, x.device, reps)
    if x.is_cuda:
        pinned = torch.empty_like(host_src, pin_memory=True)
        rates["pinned"] = rate_of(
            lambda: pinned.copy_(x, non_blocking=True), nbytes, x.device, reps
        )
        staging = HostStaging(4 << 20, CudaCopier(x.device))
        flat = x.reshape(-1).view(torch.uint8)
        ranges = [(s, min(nbytes, s + (4 << 20))) for s in range(0, nbytes, 4 << 20)]

        def staged() -> None:
            for _ in staging.chunks([flat], ranges):
                pass

        rates["staged"] = rate_of(staged, nbytes, x.device, reps)
        # The receiving side's choice, measured for it: a received tensor
        # lands in pageable memory today and the party moves it with .to().
        rates["H2D pageable"] = rate_of(
            lambda: host_src.to(x.device), nbytes, x.device, reps
        )
        landed = torch.empty_like(x)
        rates["H2D pinned"] = rate_of(
            lambda: landed.copy_(pinned, non_blocking=True), nbytes, x.device, reps
        )
    return rates


def dial(port: int, data_port: int, certs: str) -> Link:
    """A link to party B on loopback, mutual TLS, with its data plane."""
    return connect(
        f"127.0.0.1:{port}",
        token=TOKEN,
        tls=DevCerts.at(certs).client_tls(),
        timeout=60,
        data_peer=f"127.0.0.1:{data_port}",
    )


def check_exact(device: torch.device, certs: str) -> None:
    """GPU tensors through the data plane arrive as the host's do."""
    with GrpcLinkServer(
        "127.0.0.1:0",
        token=TOKEN,
        tls=DevCerts.at(certs).server_tls(),
        data_listen="127.0.0.1:0",
    ) as server:
        client = dial(server.port, server.data_port, certs)
        peer = server.accept(timeout=60)
        sent = []
        for micro, codec in enumerate(("none", "bf16", "int8")):
            for j, shape in enumerate(((3, 2_000_001), (7,), (0, 4))):
                x = torch.randn(shape, device=device)
                client.send("x", x, step=0, micro=3 * micro + j, codec=codec)
                sent.append((x.cpu(), codec))
        for micro, (x, codec) in enumerate(sent):
            got = peer.recv("x", step=0, micro=micro, timeout=TIMEOUT)
            want = x if codec == "none" else decode(encode(x, codec))
            if not torch.equal(got, want):
                raise SystemExit(
                    f"FAIL: {codec} {list(x.shape)} differs from the host's"
                )
        client.close()
        peer.close()
    print(f"exact: 9 tensors from {device} (none, bf16, int8) equal the host's")


def link_rate(make: Callable[[], torch.Tensor], plan: Plan, certs: str) -> float:
    """MB/s of ``plan.n`` tensors from ``make`` through the data plane to a
    party B in its own process, timed until B has received them all."""
    proc, (port, data_port) = start_peer("plane", certs, plan)
    link = dial(port, data_port, certs)
    nbytes = 0
    t0 = time.perf_counter()
    for i in range(plan.n):
        x = make()
        nbytes += x.numel() * x.element_size()
        link.send("act", x, step=0, micro=i)
    link.recv_scalar("done", step=0, timeout=TIMEOUT)
    seconds = time.perf_counter() - t0
    # the peer's latency and ping phases, which this bench does not time
    for i in range(1, plan.m + 1):
        link.send("act", make(), step=i)
        link.recv_scalar("ack", step=i, timeout=TIMEOUT)
    for i in range(plan.m + 1, plan.m + 1 + plan.k):
        link.send_scalar("ping", 1.0, step=i)
        link.recv_scalar("pong", step=i, timeout=TIMEOUT)
    link.send("bye", torch.zeros(1), step=plan.m + plan.k + 1)
    link.close()
    stop_peer(proc)
    return nbytes / seconds / 1e6


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--shape", default="8,1024,1280", help="fp32 tensor shape")
    ap.add_argument("--n", type=int, default=16, help="tensors per link run")
    ap.add_argument("--rounds", type=int, default=3, help="alternated link rounds")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device here: run with --device cpu for the plumbing")
    shape = tuple(int(d) for d in args.shape.split(","))
    x = torch.randn(shape, device=device)
    host = x.cpu()
    mb = x.numel() * 4 / 1e6
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(
        f"# link from {name}: {list(shape)} fp32 ({mb:.1f} MB), "
        f"torch {torch.__version__}"
    )
    rates = copy_rates(x, reps=10)
    for what, gbs in rates.items():
        print(f"  {what:<12} {gbs:6.2f} GB/s")
    plan = Plan(shape, args.n, 1, 1)
    with tempfile.TemporaryDirectory() as certs:
        make_dev_certs(certs)
        check_exact(device, certs)
        rounds = []
        for _ in range(args.rounds):  # alternated: the box's drift favours none
            rounds.append(
                (
                    link_rate(lambda: host, plan, certs),
                    link_rate(lambda: x, plan, certs),
                    link_rate(lambda: x.cpu(), plan, certs),
                )
            )
            print(
                "  link MB/s: host {:.0f}, GPU staged {:.0f}, GPU .cpu() {:.0f}".format(
                    *rounds[-1]
                )
            )
    staged = statistics.median(r[1] / r[0] for r in rounds)
    whole = statistics.median(r[2] / r[0] for r in rounds)
    na = float("nan")
    print(
        f"gpu: link from the GPU {100 * staged:.0f} % of a host tensor's rate "
        f"(.cpu() first {100 * whole:.0f} %); D2H staged {rates.get('staged', na):.1f}"
        f" GB/s, pinned {rates.get('pinned', na):.1f} GB/s, pageable "
        f"{rates['pageable']:.1f} GB/s; host memcpy {rates['host memcpy']:.1f} GB/s"
    )


if __name__ == "__main__":
    main()
