"""What to give the parties when no cut of a model fits their memory.

``plan`` refuses a device set on which no cut fits; this module words the
refusal so that it points somewhere: which party is short at the cut the
planner would choose were memory no limit (the balanced one; and that the
other fits there, where it does), and the fewest
devices per party on which some cut fits, as ``--party`` specs
(``A:1:16x80GB``), with the micro-batch size that lets a sharded party's
ranks each run a row (``model.memory``'s docstring: a party sharded over R
ranks needs micro-batches of at least R rows) and, where no number of the
party's devices can hold what every rank keeps whole, the smallest common
device size that can.

The search weighs each party alone: its peak on R devices depends on its own
pieces only, so cuts that give a party the same pieces (the same block
shapes, embedding and head) share one answer, and a party's ranks are
weighed at the peak only (``party_load(peak_only=True)``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from aisyn.model.cost import DTYPE_BYTES, PlanError, format_bytes
from aisyn.model.families import ModelConfig
from aisyn.model.memory import Workload, party_load
from aisyn.model.segments import COMPUTE_PARTY, DATA_PARTY, PARTIES, Partition
from aisyn.split.planner.plan import PartySpec

#: device memory sizes sold (GB), from which a size is suggested when no
#: number of a party's own devices holds what each of its ranks keeps whole
COMMON_DEVICE_GB = (16, 24, 32, 40, 48, 64, 80, 96, 128, 141, 192, 256, 288)
#: the largest micro-batch the search offers (rows; a sharded party's ranks
#: each need one)
MAX_ROWS = 1024


@dataclass(frozen=True)
class Fit:
    """The fewest devices on which a cut fits: per party its device count and
    per-device memory, the cut, and the workload (micro-batch size raised
    where a sharded party needs the rows)."""

    devices: dict[str, int]
    memory: dict[str, float]
    partition: Partition
    workload: Workload


def balanced_cut(
    needs: list[tuple[Partition, dict[str, float], tuple]],
) -> tuple[Partition, dict[str, float]]:
    """The cut ``plan`` would choose were memory no limit (each entry: a cut,
    its parties' peaks, and ``plan``'s key of it): the one to say who is
    short at."""
    part, peaks, _key = min(needs, key=lambda c: c[2])
    return part, peaks


def _spec_memory(n: float) -> str:
    """``80GB``, ``24GiB``, ``inf`` or bytes: a size ``--party`` parses back."""
    if math.isinf(n):
        return "inf"
    for unit, scale in (("GB", 1e9), ("GiB", 2**30), ("MB", 1e6)):
        if n >= scale and float(n / scale).is_integer():
            return f"{n / scale:.0f}{unit}"
    return f"{n:.0f}B"


def party_spec(spec: PartySpec, devices: int, memory: float) -> str:
    """``A:1:16x80GB``."""
    size = _spec_memory(memory)
    return f"{spec.name}:{spec.throughput:g}:" + (
        size if devices == 1 else f"{devices}x{size}"
    )


class _Search:
    """The fewest devices per party, each party weighed alone and each set of
    pieces once (``_key``)."""

    def __init__(self, sizes, cfg: ModelConfig, parties: dict[str, PartySpec]):
        self.sizes, self.cfg, self.parties = sizes, cfg, parties
        self.cache: dict[tuple, int | None] = {}
        self.keys: dict[tuple[str, str], tuple] = {}
        # each ordinary block's parameter shapes, as a small int (blocks alike
        # share one)
        lay = cfg.layout
        kinds: dict[tuple, int] = {}
        self.block_kind = [
            kinds.setdefault(sizes.shapes[lay.block_path(i)], len(kinds))
            for i in range(lay.num_blocks)
        ]

    def _key(self, part: Partition, party: str, w: Workload, memory: float) -> tuple:
        """What decides ``party``'s peak on any number of devices: its
        pieces (each stage's embedding, head and kinds of blocks), ``w`` and
        the device's memory."""
        pieces = self.keys.get((party, part.spec))
        if pieces is None:
            stages = part.stages_of(party)
            kinds = [self.block_kind[i] for st in stages for i in st.blocks]
            ends = (any(st.embed for st in stages), any(st.head for st in stages))
            # the data party is never pipelined: which blocks it holds
            # counts, not their order
            if party == DATA_PARTY:
                kinds.sort()
            pieces = self.keys[party, part.spec] = (ends, tuple(kinds))
        return party, pieces, w, memory

    def _peak(self, part, party, w, devices) -> float:
        try:
            ld = party_load(
                self.sizes, self.cfg, part, party, w, devices, peak_only=True
            )
        except PlanError:  # a sharded party with fewer rows than ranks
            return math.inf
        return ld.memory_bytes

    def layers(self, part: Partition, party: str) -> int:
        lay = self.cfg.layout
        stages = part.stages_of(party)
        head = any(st.head for st in stages)
        return sum(len(st.blocks) for st in stages) + (lay.head_layers if head else 0)

    def fewest(
        self, part: Partition, party: str, w: Workload, memory: float
    ) -> int | None:
        """The fewest devices of ``memory`` on which ``party``'s pieces of
        ``part`` fit under ``w`` (None: no count does)."""
        key = self._key(part, party, w, memory)
        if key not in self.cache:
            self.cache[key] = self._fewest(part, party, w, memory)
        return self.cache[key]

    def _fewest(self, part, party, w, memory) -> int | None:
        layers = self.layers(part, party)
        most = max(1, w.micro_batch_size)  # a sharded rank needs a row
        if party != DATA_PARTY:
            most = max(most, layers)  # a pipeline stage needs a block

        def fits(d: int) -> bool:
            return self._peak(part, party, w, d) <= memory

        def bisect(lo: int, hi: int) -> int | None:
            """The fewest in [lo, hi] where fitting only gets easier with
            more devices."""
            if lo > hi or not fits(hi):
                return None
            while lo < hi:
                mid = (lo + hi) // 2
                lo, hi = (lo, mid) if fits(mid) else (mid + 1, hi)
            return lo

        if fits(1):  # one device: its own schedule (the link's window)
            return 1
        stages = min(layers, most) if party != DATA_PARTY else 1
        if w.schedule == "1f1b":
            # 1F1B's first stage holds more micro-batches as stages are
            # added: fitting is not monotone, so one by one
            found = next((d for d in range(2, stages + 1) if fits(d)), None)
        else:
            # a stage's blocks (its micro-batches fixed) only shrink
            found = bisect(2, stages)
        # sharded (the data party on 2 or more, the compute party beyond one
        # device a layer): each rank's share only shrinks with more ranks
        return found or bisect(max(2, stages + 1), most)

    def fit(
        self, cuts: list[Partition], w: Workload, memory: dict[str, float]
    ) -> Fit | None:
        """The cut needing the fewest devices in all under ``w`` (ties: the
        fewer on the data party), or None."""
        best: tuple[tuple[int, int], Fit] | None = None
        for part in cuts:
            counts = {p: self.fewest(part, p, w, memory[p]) for p in PARTIES}
            if any(c is None for c in counts.values()):
                continue
            key = (sum(counts.values()), counts[DATA_PARTY])
            if best is None or key < best[0]:
                best = (key, Fit(counts, memory, part, w))
        return best[1] if best else None


def _workloads(w: Workload):
    """``w``, then with micro-batches of twice, four times ... its rows (as
    many micro-batches a step), up to ``MAX_ROWS``: what lets a sharded party
    spread over more ranks."""
    rows = w.micro_batch_size
    yield w
    while rows * 2 <= MAX_ROWS:
        rows *= 2
        yield replace(w, micro_batch_size=rows, batch_size=rows * w.micro_batches)


def fewest_devices(
    sizes,
    cfg: ModelConfig,
    cuts: list[Partition],
    parties: dict[str, PartySpec],
    w: Workload,
) -> Fit | None:
    """The fewest devices per party on which some cut fits (``Fit``): at the
    parties' own device sizes if any count of them fits, else at the smallest
    ``COMMON_DEVICE_GB`` size that does for the party that needs it."""
    search = _Search(sizes, cfg, parties)
    own = {p: parties[p].memory_bytes for p in PARTIES}
    largest = replace(
        w, micro_batch_size=MAX_ROWS, batch_size=MAX_ROWS * w.micro_batches
    )

    def can_fit(party: str, memory: float) -> bool:
        """Whether any count of such devices holds the party at some cut, at
        ``w`` or at the most rows (more rows let a sharded party spread
        wider; fewer keep a pipeline stage's micro-batches small)."""
        return any(
            search.fewest(c, party, work, memory) for work in (w, largest) for c in cuts
        )

    sizes_to_try: dict[str, list[float]] = {}
    for p, other in ((DATA_PARTY, COMPUTE_PARTY), (COMPUTE_PARTY, DATA_PARTY)):
        fits_own = can_fit(p, own[p])
        # the other party's device first (a consortium often has one kind),
        # then the common sizes above the party's own
        larger = [own[other]] if own[p] < own[other] < math.inf else []
        larger += [g * 1e9 for g in COMMON_DEVICE_GB if g * 1e9 > own[p]]
        sizes_to_try[p] = (
            [own[p]] if fits_own else sorted(set(larger), key=larger.index)
        )
    for a_mem in sizes_to_try[DATA_PARTY]:
        for b_mem in sizes_to_try[COMPUTE_PARTY]:
            memory = {DATA_PARTY: a_mem, COMPUTE_PARTY: b_mem}
            if not all(can_fit(p, memory[p]) for p in PARTIES):
                continue
            for work in _workloads(w):
                found = search.fit(cuts, work, memory)
                if found:
                    return found
    return None


def no_fit_message(
    model_name: str,
    shape: str,
    closest: tuple[Partition, dict[str, float]],
    parties: dict[str, PartySpec],
    w: Workload,
    fit: Fit | None,
) -> str:
    """The one line ``plan`` refuses with."""
    part, needs = closest
    short, fine = [], []
    for p in PARTIES:
        have = parties[p].memory_bytes
        (short if needs[p] > have else fine).append(
            f"{p} needs {format_bytes(needs[p])} per device and has {parties[p].label}"
            if needs[p] > have
            else f"{p} fits there, {format_bytes(needs[p])} of {format_bytes(have)}"
        )
    line = (
        f"no {shape} cut of {model_name} fits the parties' memory: at the "
        f"balanced cut {part.spec}, " + ", and ".join(short)
    )
    if fine:
        line += f" ({fine[0]})"
    if fit is not None:
        specs = " ".join(
            f"--party {party_spec(parties[p], fit.devices[p], fit.memory[p])}"
            for p in PARTIES
        )
        line += f"; the fewest devices that fit: {specs}"
        if fit.workload.micro_batch_size != w.micro_batch_size:
            line += (
                f" --batch-size {fit.workload.batch_size} --micro-batch-size "
                f"{fit.workload.micro_batch_size}"
            )
        line += f", cut {fit.partition.spec}"
        if fit.workload.micro_batch_size != w.micro_batch_size:
            line += " (each rank of a sharded party runs a row of every micro-batch)"
    others = ["lower --micro-batch-size/--seq-len"]
    if DTYPE_BYTES[w.dtype] > 2 and not w.autocast:
        others.append("use --dtype bf16")
    if not w.activation_checkpointing:
        others.append("add --activation-checkpointing")
    return f"{line}; or {', or '.join(others)}"
