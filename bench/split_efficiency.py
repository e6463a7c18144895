"""Split-training efficiency: the reference's table, reproduced in one run.

Unsplit training (``train.executor.LocalExecutor``) against split training of the same
model on the same batches, with the same seed and micro-batching:

* in-process (both parties in this process, in-memory link);
* over the network link on loopback (the compute party is a separate ``aisyn
  split serve`` process, mutual TLS, its bulk data plane beside the gRPC
  control stream), lockstep and pipelined, each cut-layer codec;
* the same through a shaped link (``ShapedProxy`` in front of both the control
  stream and the data plane: added round-trip latency and a bandwidth cap per
  direction), where pipelining and compression must win back most of the time
  lockstep loses.

Per configuration: median step time, tokens/s, ratio to the unsplit baseline,
and bytes on the wire per step. Also the effect of int8 compression on the
loss curve (same init, same batches), and the transport microbenchmark
(``bench/link_throughput.py``: link vs plain socket, same tensor shape).

Every split step is paired with an unsplit step on the same batch, run right
after it; "x baseline" is the median over steps of split / paired-unsplit time,
so a machine whose speed drifts (other jobs, clock changes) favours neither.
With two or more CPUs the compute party runs on its own core, as it would on
its own machine; ``--cpus 1`` pins everything to one core, so pipelining can
only hide link waits and cannot add compute.

    python bench/split_efficiency.py --quick          # ~10 min on 2 cores
    python bench/split_efficiency.py                  # the docs/split.md table
    python bench/split_efficiency.py --cpus 1 --sections in-process,loopback,shaped

The ``balanced`` section measures pipelining where the cut allows it: the
model made deep enough (``--override num_layers=...`` of the shallowest depth,
from the model's own up) that the cut the planner chooses for ``--pipeline``
on two equal parties leaves the busier party at most ``BALANCED_FLOOR`` of the
compute, with that cut; it prints ``pipelined xN.NNN, planner floor xN.NNN``
in-process and over loopback mTLS (goal: pipelined <= 1.08 x the floor).

    python bench/split_efficiency.py --quick --sections balanced
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from aisyn.data.corpora import load_corpus
from aisyn.data.shards import open_many, prepare
from aisyn.data.tokenizer import PanguTokenizer
from aisyn.link import ShapedProxy
from aisyn.link.memory import memory_pair
from aisyn.model.cost import block_forward_flops_per_token, head_forward_flops_per_token
from aisyn.model.families import build_model, load_config
from aisyn.model.memory import Workload
from aisyn.model.segments import (
    COMPUTE_PARTY,
    DATA_PARTY,
    init_seeds,
    parse_partition,
)
from aisyn.net import free_port
from aisyn.split import protocol as proto
from aisyn.split import schedule
from aisyn.split.backbone.compute_party import ComputeParty
from aisyn.split.client.data_party import DataSession
from aisyn.split.party import PartyState
from aisyn.split.planner import PartySpec, evaluate, plan
from aisyn.split.session import open_grpc, spawn_compute_party
from aisyn.split.transport import link_options
from aisyn.train.config import TrainConfig
from aisyn.train.executor import LocalExecutor
from aisyn.train.objective import lm_step_batch
from aisyn.train.sampler import BatchSampler

CODECS = ("none", "fp16", "bf16", "int8")


@dataclass
class Result:
    name: str
    link: str
    schedule: str
    codec: str
    step_times: list[float]
    sent: float = 0.0  # wire bytes per step A->B
    received: float = 0.0  # B->A
    losses: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)  # CPU s/step, both parties
    base_times: list[float] = field(default_factory=list)  # paired baseline steps
    base_cpu: list[float] = field(default_factory=list)
    base_losses: list[float] = field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(self.step_times)

    @property
    def ratio(self) -> float:
        """Step time over the paired baseline's (median over step pairs)."""
        if not self.base_times:
            return 1.0
        return statistics.median(
            t / b for t, b in zip(self.step_times, self.base_times, strict=True)
        )

    @property
    def cpu_ratio(self) -> float:
        """CPU seconds per step (both parties) over the paired baseline's: the
        work split training adds, which other processes' load hardly moves."""
        return statistics.median(
            t / b for t, b in zip(self.cpu, self.base_cpu, strict=True)
        )


def prepare_data(seq_len: int, max_docs: int) -> Path:
    root = Path(os.environ.get("AISYN_CACHE", Path.home() / ".cache" / "aisyn"))
    out = root / "bench" / f"news-{seq_len}-{max_docs}"
    if not (out / "manifest.json").is_file():
        tok = PanguTokenizer.load()
        prepare(
            load_corpus("news"),
            tok,
            seq_len,
            out,
            max_documents=max_docs,
            corpus_specs=["news"],
        )
    return out


def fixed_batches(data: Path, n: int, batch_size: int, seed: int) -> list[torch.Tensor]:
    sampler = BatchSampler(open_many([data], "train"), seed=seed)
    return [sampler.next_batch(batch_size) for _ in range(n)]


class Baseline:
    """The unsplit model, stepped between the split configuration's steps."""

    def __init__(self, cfg, tcfg) -> None:
        self.tcfg = tcfg
        self.model = build_model(cfg, seed=tcfg.seed).to(tcfg.device)
        self.executor = LocalExecutor(self.model, self.model.named_parameters(), tcfg)
        self.model.train()
        self.times: list[float] = []
        self.cpu: list[float] = []
        self.losses: list[float] = []

    def step(self, batch: torch.Tensor, step: int) -> None:
        t0, c0 = time.perf_counter(), time.process_time()
        res = self.executor.step(step, lm_step_batch(batch, self.tcfg.micro, None))
        sync(self.tcfg.device)
        self.times.append(time.perf_counter() - t0)
        self.cpu.append(time.process_time() - c0)
        self.losses.append(res["loss"])


def sync(device: str) -> None:
    """A step's time includes its device work (queued kernels finish first)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def cpu_seconds(pid: int | None) -> float:
    """CPU time (user + system) of this process, plus ``pid``'s if given."""
    total = time.process_time()
    if pid is not None:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def run_session(
    name,
    link_name,
    link,
    cfg,
    part,
    tcfg,
    batches,
    window,
    codec,
    warmup,
    paired=True,
    peer_pid=None,
):
    """Steps the split model, each step right after a baseline step on the same
    batch (paired: load from other processes hits both alike)."""
    state = PartyState(cfg, part, DATA_PARTY, tcfg, torch.device(tcfg.device))
    session = DataSession(state, link, eod_id=None, window=window)
    base = Baseline(cfg, tcfg) if paired else None
    times, cpu, sent, recv, losses = [], [], [], [], []
    for step, batch in enumerate(batches):
        if base is not None:
            base.step(batch, step)
        s0, r0 = link.bytes_sent, link.bytes_received
        t0, c0 = time.perf_counter(), cpu_seconds(peer_pid)
        step_batch = lm_step_batch(batch, tcfg.micro, None)
        res = session.train_micro_batches(step_batch.micro, step, step_batch.loss_of)
        link.flush()
        sync(tcfg.device)
        times.append(time.perf_counter() - t0)
        cpu.append(cpu_seconds(peer_pid) - c0)
        sent.append(link.bytes_sent - s0)
        recv.append(link.bytes_received - r0)
        losses.append(res["loss"])
    sched = "lockstep" if window == 0 else f"pipelined ({window} in flight)"
    w = warmup
    r = Result(
        name,
        link_name,
        sched,
        codec,
        times[w:],
        statistics.mean(sent[w:]),
        statistics.mean(recv[w:]),
        losses,
        cpu[w:],
    )
    if base is not None:
        r.base_times = base.times[w:]
        r.base_cpu = base.cpu[w:]
        r.base_losses = base.losses
    return r


def hello(cfg, part, tcfg, codec) -> dict:
    return proto.hello(
        purpose="train",
        run_id="bench-" + secrets.token_hex(6),
        model=cfg.to_dict(),
        partition=part.to_dict(),
        train=tcfg,
        init_seeds=init_seeds(cfg, part, COMPUTE_PARTY, tcfg.seed),
        codec=codec,
    )


def run_in_process(
    cfg, part, tcfg, batches, window, codec, warmup, paired=True
) -> Result:
    party = ComputeParty(cfg, part, None, device=tcfg.device)
    link_a, link_b = memory_pair(codec, options=link_options(codec))
    _, b_session = party.negotiate(
        proto.encode_json(hello(cfg, part, tcfg, codec)), link_b.peer.identity
    )
    errors: list[BaseException] = []

    def serve() -> None:
        try:
            party.serve_session(link_b, b_session)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)
        finally:
            link_b.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        return run_session(
            "split, in-process",
            "memory",
            link_a,
            cfg,
            part,
            tcfg,
            batches,
            window,
            codec,
            warmup,
            paired,
        )
    finally:
        link_a.close()
        thread.join(30)
        if errors:
            raise errors[0]


def run_grpc(
    settings, name, link_name, cfg, part, tcfg, batches, window, codec, warmup, pid
) -> Result:
    with open_grpc(
        settings, hello(cfg, part, tcfg, codec), codec=codec, connect_timeout_s=60
    ) as opened:
        return run_session(
            name,
            link_name,
            opened.link,
            cfg,
            part,
            tcfg,
            batches,
            window,
            codec,
            warmup,
            peer_pid=pid,
        )


@contextlib.contextmanager
def shaped_link(port: int, rtt_ms: float, mbit: float, cpus: list[int]):
    """A ``ShapedProxy`` to ``port``; yields its port. With ``cpus`` it runs in
    its own process pinned to them, so shaping costs the parties no CPU time
    (on a real WAN the network does this work, not the parties)."""
    if not cpus:
        with ShapedProxy(
            0, "127.0.0.1", port, latency_ms_rtt=rtt_ms, bandwidth_bits_per_s=mbit * 1e6
        ) as proxy:
            yield proxy.port
        return
    code = (
        "import sys; from aisyn.link import ShapedProxy\n"
        f"p = ShapedProxy(0, '127.0.0.1', {port}, latency_ms_rtt={rtt_ms}, "
        f"bandwidth_bits_per_s={mbit * 1e6}).start()\n"
        "print(p.port, flush=True); sys.stdin.read(); p.stop()"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: os.sched_setaffinity(0, cpus),
    )
    try:
        yield int(proc.stdout.readline())
    finally:
        proc.stdin.close()
        proc.wait(timeout=30)


def transport_microbench(shape: tuple[int, ...], quick: bool, threads: int) -> str:
    script = Path(__file__).with_name("link_throughput.py")
    if not script.is_file():
        return "(bench/link_throughput.py not found)"
    args = [sys.executable, str(script), "--shape", ",".join(map(str, shape))]
    args += ["--codecs", "none,int8"] + (["--quick"] if quick else [])
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}  # as the parties run
    res = subprocess.run(args, capture_output=True, text=True, timeout=900, env=env)
    if res.returncode:
        return f"(link_throughput.py failed: {res.stderr.strip().splitlines()[-1:]})"
    return res.stdout.strip()


def table(rows: list[Result], base: float, tokens: int) -> str:
    out = [
        "| configuration | link | schedule | codec | step time (s) | paired "
        "unsplit (s) | tokens/s | × baseline | CPU × baseline | wire MB/step A→B "
        "| wire MB/step B→A |",
        "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|",
        f"| unsplit baseline | - | - | - | {base:.3f} | - | {tokens / base:,.0f} "
        "| 1 | 1 | - | - |",
    ]
    for r in rows:
        out.append(
            f"| {r.name} | {r.link} | {r.schedule} | {r.codec} | {r.median:.3f} "
            f"| {statistics.median(r.base_times):.3f} | {tokens / r.median:,.0f} "
            f"| {r.ratio:.3f} | {r.cpu_ratio:.3f} "
            f"| {r.sent / 1e6:.2f} | {r.received / 1e6:.2f} |"
        )
    return "\n".join(out)


SECTIONS = ("in-process", "loopback", "shaped", "loss", "transport", "balanced")
#: the balanced section's model is deep enough that the planner's cut leaves
#: the busier party at most this share of the compute (issue 37's goal: 0.56)
BALANCED_FLOOR = 0.56
#: and its pipelined step should take at most this times that floor
BALANCED_GOAL = 1.08


def parse_overrides(text: str | None) -> dict:
    """``hidden_size=512,ffn_size=2048`` -> model config overrides (ints)."""
    out = {}
    for item in filter(None, (text or "").split(",")):
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--override {item!r}: expected KEY=VALUE")
        out[key.strip()] = int(value)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer steps, fewer configs")
    ap.add_argument("--model", default="small", help="preset or JSON config")
    ap.add_argument(
        "--override",
        default=None,
        help="model config overrides, e.g. hidden_size=512,ffn_size=2048",
    )
    ap.add_argument("--cut", default="u:1,1")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--micro-batch-size", type=int, default=1)
    ap.add_argument("--window", type=int, default=2, help="pipelined: in flight")
    ap.add_argument(
        "--balanced-batch-size",
        type=int,
        default=16,
        help="the balanced section's batch (16 micro-batches of 1: at 8 the "
        "schedule's fill and drain alone take 1.096x the floor, above the goal)",
    )
    ap.add_argument("--steps", type=int, default=None, help="measured steps/config")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads per party process (and for the baseline)",
    )
    ap.add_argument(
        "--cpus",
        type=int,
        default=None,
        help="pin this benchmark and the compute party to the first N CPUs "
        "(1: both parties and the baseline share one core, so pipelining can only "
        "hide link waits, not add a second core)",
    )
    ap.add_argument("--rtt-ms", type=float, default=20.0)
    ap.add_argument("--mbit", type=float, default=1000.0)
    ap.add_argument("--loss-steps", type=int, default=None, help="int8 loss curve")
    ap.add_argument(
        "--sections",
        default=",".join(SECTIONS),
        help=f"comma-separated subset of {', '.join(SECTIONS)}",
    )
    ap.add_argument("--json", default=None, help="also write results here")
    ap.add_argument(
        "--device",
        default="cpu",
        help="both parties' and the baseline's (cuda: bf16 autocast, as aisyn train)",
    )
    args = ap.parse_args(argv)
    sections = set(args.sections.split(","))
    if sections - set(SECTIONS):
        raise SystemExit(f"--sections: unknown {sorted(sections - set(SECTIONS))}")
    steps = args.steps or (4 if args.quick else 10)
    loss_steps = args.loss_steps or (20 if args.quick else 60)
    torch.set_num_threads(args.threads)
    spare: list[int] = []
    if args.cpus:
        # Inherited by the spawned compute party. The shaped link's proxy (the
        # "network") then runs on the CPUs left over, not on the parties' cores.
        cpus = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, cpus[: args.cpus])
        spare = cpus[args.cpus :]

    cfg = load_config(args.model, **parse_overrides(args.override))
    part = parse_partition(args.cut, cfg)
    data = prepare_data(cfg.seq_len, 3000)
    n = args.warmup + steps
    tcfg = TrainConfig(
        steps=max(n, loss_steps),
        batch_size=args.batch_size,
        micro_batch_size=args.micro_batch_size,
        lr=1e-3,
        warmup_steps=5,
        seed=1234,
        device=args.device,
    )
    batches = fixed_batches(data, max(n, loss_steps), args.batch_size, tcfg.seed)
    batches = [b.to(args.device) for b in batches]
    tokens = args.batch_size * cfg.seq_len
    params = build_model(cfg, device="meta").num_parameters()
    print(
        f"# split efficiency: model {args.model}"
        f"{' + ' + args.override if args.override else ''} ({params:,} params, "
        f"hidden {cfg.hidden_size}, seq {cfg.seq_len}), cut {part.spec} "
        f"({part.describe()}), batch {args.batch_size} = {tcfg.grad_accum} x "
        f"micro-batch {tcfg.micro}; {steps} measured steps per configuration after "
        f"{args.warmup} warm-up, each paired with an unsplit step on the same "
        f"batch; torch {torch.__version__}, {args.threads} thread(s) per process, "
        f"{len(os.sched_getaffinity(0))} of {os.cpu_count()} CPUs, {args.device}",
        flush=True,
    )
    print(f"# {pipelining_floor(args.model, cfg, part, tcfg)}", flush=True)

    def log(r: Result) -> None:
        print(
            f"  {r.name:<18} {r.link:<30} {r.schedule:<24} {r.codec:<5} "
            f"{r.median:.3f} s/step, x{r.ratio:.3f} of paired baseline "
            f"({statistics.median(r.base_times):.3f} s), CPU x{r.cpu_ratio:.3f}",
            file=sys.stderr,
            flush=True,
        )

    grpc_codecs = ("none", "int8") if args.quick else CODECS
    rows: list[Result] = []  # in-process and loopback
    shaped_rows: list[Result] = []

    if "in-process" in sections:
        for window in (0, args.window):
            rows.append(
                run_in_process(
                    cfg, part, tcfg, batches[:n], window, "none", args.warmup
                )
            )
            log(rows[-1])

    if sections & {"loopback", "shaped"}:
        env = {"OMP_NUM_THREADS": str(args.threads)}
        with tempfile.TemporaryDirectory() as tmp:
            # Its bulk data plane on a port known here, so the shaped section
            # can put a shaper in front of it too.
            data_port = free_port()
            server = spawn_compute_party(
                Path(tmp) / "b",
                cfg,
                part,
                Path(tmp) / "b-runs",
                device=args.device,
                env=env,
                data_listen=f"127.0.0.1:{data_port}",
            )

            def grpc(settings, link_name, window, codec, tc=tcfg) -> Result:
                r = run_grpc(
                    settings,
                    "split, gRPC",
                    link_name,
                    cfg,
                    part,
                    tc,
                    batches[:n],
                    window,
                    codec,
                    args.warmup,
                    server.proc.pid,
                )
                log(r)
                return r

            try:
                if "loopback" in sections:
                    for window in (0, args.window):
                        for codec in grpc_codecs if window else ("none",):
                            rows.append(
                                grpc(server.settings, "loopback, mTLS", window, codec)
                            )
                    # Lockstep pays the link's per-message cost 4x per micro-batch;
                    # with one micro-batch per step, 4x per step (the paired
                    # baseline then runs the same single micro-batch).
                    whole = dataclasses.replace(tcfg, micro_batch_size=args.batch_size)
                    r = grpc(server.settings, "loopback, mTLS", 0, "none", whole)
                    r.schedule = f"lockstep, 1 x micro-batch {args.batch_size}"
                    rows.append(r)
                if "shaped" in sections:
                    port = int(server.settings.address.rpartition(":")[2])
                    with (
                        shaped_link(port, args.rtt_ms, args.mbit, spare) as p_port,
                        shaped_link(data_port, args.rtt_ms, args.mbit, spare) as d_port,
                    ):
                        # Both the control stream and the data plane shaped.
                        shaped = dataclasses.replace(
                            server.settings,
                            address=f"127.0.0.1:{p_port}",
                            data_address=f"127.0.0.1:{d_port}",
                        )
                        name = f"shaped {args.rtt_ms:g} ms RTT, {args.mbit:g} Mbit/s"
                        configs = [(0, "none"), (0, "int8")]
                        configs += [(args.window, c) for c in grpc_codecs]
                        for window, codec in configs:
                            shaped_rows.append(grpc(shaped, name, window, codec))
            finally:
                server.stop()

    everything = rows + shaped_rows
    result: dict = {"rows": [r.__dict__ for r in everything]}
    if everything:
        base = statistics.median(t for r in everything for t in r.base_times)
        result["baseline"] = base
        medians = [statistics.median(r.base_times) for r in everything]
        print()
        print(table(everything, base, tokens))
        print()
        print(
            f"baseline: median {base:.3f} s/step over all {len(everything)} "
            f"pairings (per pairing {min(medians):.3f}-{max(medians):.3f} s); "
            "'x baseline' is the median over steps of split/paired-unsplit step "
            "time; 'CPU x baseline' the same for CPU seconds of both parties' "
            "processes"
        )
        print_targets(rows, shaped_rows, tcfg)
        # Exactness on the way: lossless configurations match the unsplit
        # losses (same init, same batches).
        worst = max(
            abs(a - b) / abs(b)
            for r in everything
            if r.codec == "none"
            for a, b in zip(r.losses, r.base_losses, strict=True)
        )
        print(f"lossless configurations: max relative loss difference {worst:.2e}")

    if "loss" in sections:
        # int8's effect on the loss curve, in-process (same init and batches).
        loss_batches = batches[:loss_steps]
        none, int8 = (
            run_in_process(
                cfg, part, tcfg, loss_batches, args.window, c, 0, paired=False
            )
            for c in ("none", "int8")
        )
        diffs = [abs(a - b) for a, b in zip(int8.losses, none.losses, strict=True)]
        print(
            f"int8 cut compression over {loss_steps} steps: loss "
            f"{none.losses[0]:.4f} -> {none.losses[-1]:.4f} lossless vs "
            f"{int8.losses[0]:.4f} -> {int8.losses[-1]:.4f} int8; max |diff| "
            f"{max(diffs):.4f}, mean |diff| {statistics.mean(diffs):.4f}, final "
            f"diff {int8.losses[-1] - none.losses[-1]:+.4f} nats"
        )
        result["int8_losses"], result["none_losses"] = int8.losses, none.losses

    if "transport" in sections:
        micro_shape = (tcfg.micro, cfg.seq_len, cfg.hidden_size)
        print()
        print(f"transport microbenchmark (one cut tensor, {list(micro_shape)} fp32):")
        print(transport_microbench(micro_shape, args.quick, args.threads))

    if "balanced" in sections:
        result["balanced"] = balanced_section(args, cfg, tcfg, data, n, log)

    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


def balanced_cut(model: str, cfg, tcfg, window: int):
    """(config, the planner's cut, its floor): the shallowest depth, from
    ``cfg``'s own up, at which the cut ``aisyn split plan --pipeline window``
    chooses for two equal parties leaves the busier one at most
    ``BALANCED_FLOOR`` of the compute."""
    equal = [PartySpec(p, 1.0, math.inf) for p in (DATA_PARTY, COMPUTE_PARTY)]
    work = Workload(
        tcfg.batch_size, tcfg.micro, seq_len=cfg.seq_len, in_flight=window + 1
    )
    for layers in range(cfg.num_layers, cfg.num_layers + 64):
        deep = dataclasses.replace(cfg, num_layers=layers)
        chosen = plan(model, deep, equal, work)
        floor = chosen.pipelined_time / chosen.lockstep_time
        if floor <= BALANCED_FLOOR:
            return deep, chosen.partition, floor
    raise SystemExit(
        f"balanced: no depth up to {cfg.num_layers + 63} layers gives a cut "
        f"with a floor <= {BALANCED_FLOOR}"
    )


_NEEDS = {("b", "F"): ("a", "F"), ("a", "L"): ("b", "F"), ("b", "B"): ("a", "L")}
_NEEDS[("a", "B")] = ("b", "B")


def makespan(sched: schedule.Schedule, cost: dict[str, dict[str, float]]) -> float:
    """When the last op of ``sched`` ends, each op taking ``cost[party][kind]``
    and starting once its party is free and what it needs (``schedule``'s
    cross-party dependencies) has ended: the step time of the schedule alone,
    with a free link and no overhead."""
    free = {"a": 0.0, "b": 0.0}
    ended: dict[tuple[str, str, int], float] = {}
    pos = {"a": 0, "b": 0}
    ops = {"a": sched.a, "b": sched.b}
    while pos["a"] < len(ops["a"]) or pos["b"] < len(ops["b"]):
        moved = False
        for p in "ab":
            if pos[p] == len(ops[p]):
                continue
            kind, i = ops[p][pos[p]]
            need = _NEEDS.get((p, kind))
            if need and (*need, i) not in ended:
                continue
            start = max(free[p], ended[(*need, i)] if need else 0.0)
            free[p] = ended[(p, kind, i)] = start + cost[p][kind]
            pos[p] += 1
            moved = True
        if not moved:
            raise RuntimeError("schedule deadlocks")
    return max(free.values())


def schedule_bound(cfg, part, micro_batches: int, window: int) -> float:
    """The pipelined schedule's step time over the unsplit step's, each op
    taking its share of the planner's FLOPs (forward 1, backward 2): what the
    fill and drain of ``micro_batches`` micro-batches add to the floor."""
    T = cfg.seq_len
    block = block_forward_flops_per_token(cfg, T)
    lay = cfg.layout
    front = part.front * block
    back = (part.back + lay.head_layers) * block + head_forward_flops_per_token(cfg)
    middle = len(part.middle) * block
    cost = {
        "a": {"F": front, "L": 3 * back, "B": 2 * front},
        "b": {"F": middle, "B": 2 * middle},
    }
    unsplit = micro_batches * 3 * (front + back + middle)
    return makespan(schedule.pipelined(micro_batches, window), cost) / unsplit


def balanced_section(args, cfg, tcfg, data, n, log) -> dict:
    """The pipelined step on a model deep enough for a balanced cut, with the
    planner's cut, in-process and over loopback mTLS, against the floor, at
    ``--balanced-batch-size``."""
    tcfg = dataclasses.replace(tcfg, batch_size=args.balanced_batch_size)
    deep, part, floor = balanced_cut(args.model, cfg, tcfg, args.window)
    batches = fixed_batches(data, n, tcfg.batch_size, tcfg.seed)
    print(
        f"\n# balanced: {args.model} with num_layers={deep.num_layers} "
        f"({build_model(deep, device='meta').num_parameters():,} params), the "
        f"planner's cut for --pipeline {args.window} on two equal parties "
        f"{part.spec} ({part.describe()})",
        flush=True,
    )
    print(f"# {pipelining_floor(args.model, deep, part, tcfg)}", flush=True)
    rows = [run_in_process(deep, part, tcfg, batches, args.window, "none", args.warmup)]
    log(rows[-1])
    env = {"OMP_NUM_THREADS": str(args.threads)}
    with tempfile.TemporaryDirectory() as tmp:
        server = spawn_compute_party(
            Path(tmp) / "b",
            deep,
            part,
            Path(tmp) / "b-runs",
            device="cpu",
            env=env,
            data_listen=f"127.0.0.1:{free_port()}",
        )
        try:
            rows.append(
                run_grpc(
                    server.settings,
                    "split, gRPC",
                    "loopback, mTLS",
                    deep,
                    part,
                    tcfg,
                    batches,
                    args.window,
                    "none",
                    args.warmup,
                    server.proc.pid,
                )
            )
            log(rows[-1])
        finally:
            server.stop()
    goal = BALANCED_GOAL * floor
    bound = schedule_bound(deep, part, tcfg.grad_accum, args.window)
    print(
        f"# the schedule alone (free link, no overhead, ops timed by the "
        f"planner's FLOPs): x{bound:.3f}, {bound / floor:.3f} x the floor: the "
        f"fill (B waits for A's first front) and drain (A waits for B's last "
        f"backward) of {tcfg.grad_accum} micro-batches at {args.window} in flight"
    )
    for r in rows:
        met = r.ratio <= goal and floor <= BALANCED_FLOOR
        print(
            f"balanced cut {part.spec} of {deep.num_layers} layers, {r.link}, "
            f"{tcfg.grad_accum} micro-batches, {args.window} in flight: pipelined "
            f"x{r.ratio:.3f}, planner floor x{floor:.3f} (pipelined / floor "
            f"{r.ratio / floor:.3f}; goal: pipelined <= {BALANCED_GOAL} x floor = "
            f"x{goal:.3f}, floor <= {BALANCED_FLOOR}: {'met' if met else 'missed'})"
        )
    return {
        "schedule_bound": bound,
        "num_layers": deep.num_layers,
        "cut": part.spec,
        "floor": floor,
        "rows": [r.__dict__ for r in rows],
    }


def pipelining_floor(model: str, cfg, part, tcfg) -> str:
    """What the cut allows pipelining, from the planner's FLOP counts: with a
    core each, a pipelined step takes at least the busier party's share of the
    unsplit step (compute only, before the pipeline's fill and drain)."""
    equal = {p: PartySpec(p, 1.0, math.inf) for p in (DATA_PARTY, COMPUTE_PARTY)}
    work = Workload(tcfg.batch_size, tcfg.micro, seq_len=cfg.seq_len)
    plan = evaluate(model, cfg, part, equal, work)
    a, b = (
        plan.time_units(p) / plan.lockstep_time for p in (DATA_PARTY, COMPUTE_PARTY)
    )
    return (
        f"compute per step: A {100 * a:.1f} %, B {100 * b:.1f} % (planner's FLOPs): "
        f"pipelined on a core each can reach x{max(a, b):.3f} of unsplit at best"
    )


def print_targets(rows: list[Result], shaped_rows: list[Result], tcfg) -> None:
    in_proc = [r for r in rows if r.link == "memory" and r.schedule == "lockstep"]
    if in_proc:
        print(f"in-process lockstep: x{in_proc[0].ratio:.3f} (target <= 1.03)")
    loopback = [r for r in rows if r.link.startswith("loopback")]
    if loopback:
        lock = next(r for r in loopback if r.schedule == "lockstep")
        whole = next(r for r in loopback if r.schedule.startswith("lockstep, 1"))
        exact = min(
            (r for r in loopback if r.codec == "none" and r is not whole),
            key=lambda r: r.ratio,
        )
        print(
            f"gRPC loopback, {tcfg.grad_accum} micro-batches: lockstep "
            f"x{lock.ratio:.3f}, best exact (codec none) x{exact.ratio:.3f} "
            f"({exact.schedule}); lockstep with 1 micro-batch x{whole.ratio:.3f} "
            "(target <= 1.10)"
        )
    if shaped_rows:
        lock = shaped_rows[0].ratio

        def won_back(r: Result) -> float:
            return (lock - r.ratio) / (lock - 1) if lock > 1 else math.nan

        plain = next(r for r in shaped_rows[2:] if r.codec == "none")
        best = max((r for r in shaped_rows[2:] if r.codec != "none"), key=won_back)
        print(
            f"shaped link: lockstep x{lock:.3f}, i.e. it loses "
            f"{100 * (lock - 1):.0f}% of a step; pipelined alone "
            f"(x{plain.ratio:.3f}) wins back {100 * won_back(plain):.0f}% of that, "
            f"pipelined + {best.codec} (x{best.ratio:.3f}) "
            f"{100 * won_back(best):.0f}% (target >= 80%)"
        )


if __name__ == "__main__":
    sys.exit(main())
