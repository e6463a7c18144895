"""Pick where to cut a model between two parties, from their compute and
memory: every cut weighed with the memory model (``model.memory``), the one
that balances the parties' compute time within their devices' memory kept.
Nothing here runs the model; a 200B plan takes seconds."""

from __future__ import annotations

import logging
import time

from aisyn.model.cost import PlanError, module_sizes
from aisyn.model.families import ModelConfig, build_model
from aisyn.model.memory import Workload, party_load
from aisyn.model.segments import PARTIES, Partition
from aisyn.split.planner.plan import PartySpec, Plan

log = logging.getLogger(__name__)


def evaluate(
    model_name: str,
    cfg: ModelConfig,
    partition: Partition,
    parties: dict[str, PartySpec],
    workload: Workload,
    sizes: dict[str, int] | None = None,
) -> Plan:
    """The :class:`Plan` of a given cut (``sizes``: ``module_sizes`` of the model,
    to skip rebuilding it on meta)."""
    sizes = sizes or module_sizes(build_model(cfg, device="meta"))
    loads = {
        p: party_load(sizes, cfg, partition, p, workload, parties[p].devices)
        for p in PARTIES
    }
    total = sum(sizes.values())
    return Plan(model_name, cfg, partition, workload, parties, loads, total)


#: Blocks the data party keeps on each side of B by default. With none before
#: the cut, A sends the raw token embeddings, which anyone who knows the
#: embedding inverts by nearest-neighbour lookup; with none after it, B's
#: output is one LayerNorm and the top query layer away from the logits.
MIN_A_BLOCKS = 1


def exposure_warning(partition: Partition) -> str | None:
    """Why a cut with no block on a side of A gives A's data away, if it does."""
    sides = []
    if partition.front == 0:
        sides.append(
            "no block before the front cut: A sends the raw token embeddings, "
            "which the compute party inverts to the tokens by nearest-neighbour "
            "lookup in the embedding"
        )
    if partition.is_u_shape and partition.back == 0:
        sides.append(
            "no block after the back cut: what B returns is one LayerNorm and the "
            "top query layer away from the logits, so its gradient gives the "
            "labels away"
        )
    if not sides:
        return None
    return f"cut {partition.spec} keeps " + "; and ".join(sides)


def candidates(cfg: ModelConfig, shape: str, min_a_blocks: int) -> list[Partition]:
    """Every cut of ``shape`` with at least ``min_a_blocks`` blocks of A on each
    side of B (before the cut only, for a two-way cut)."""
    n = cfg.num_blocks
    k0 = min_a_blocks
    if shape == "u":
        return [
            Partition(cfg.layout, f, k) for f in range(k0, n) for k in range(k0, n - f)
        ]
    if shape == "two-way":
        return [Partition(cfg.layout, f, None) for f in range(k0, n)]
    raise PlanError(f"shape {shape!r}: use 'u' or 'two-way'")


#: a plan that takes longer than this logs how far it is, then again every
#: ``PROGRESS_EVERY_S`` (200B's 1 891 cuts take about 2 s on a quiet box)
PROGRESS_AFTER_S = 3.0
PROGRESS_EVERY_S = 5.0


def plan(
    model_name: str,
    cfg: ModelConfig,
    parties: list[PartySpec],
    workload: Workload,
    *,
    shape: str = "u",
    min_a_blocks: int = MIN_A_BLOCKS,
) -> Plan:
    """The cut that balances compute time (FLOPs / throughput) within memory.

    Minimises the slower party's compute time per step (the step time when the
    parties pipeline); ties go to fewer blocks on A. A keeps at least
    ``min_a_blocks`` blocks on each side of B (a privacy constraint: see
    ``MIN_A_BLOCKS``). Raises PlanError if no cut fits both memory limits.
    """
    by_name = {p.name: p for p in parties}
    if sorted(by_name) != sorted(PARTIES) or len(parties) != 2:
        raise PlanError("give exactly one --party A:... and one --party B:...")
    if workload.seq_len and workload.seq_len > cfg.seq_len:
        raise PlanError(f"seq_len {workload.seq_len} exceeds the model's {cfg.seq_len}")
    sides = 2 if shape == "u" else 1
    if min_a_blocks < 0 or sides * min_a_blocks >= cfg.num_blocks:
        raise PlanError(
            f"--min-a-blocks {min_a_blocks}: the model has {cfg.num_blocks} "
            f"ordinary blocks; A would take {sides * min_a_blocks} and B needs at "
            "least one"
        )
    sizes = module_sizes(build_model(cfg, device="meta"))
    best: tuple[tuple[float, int], Plan] | None = None
    needs: list[tuple[Partition, dict[str, float], tuple]] = []  # each cut's
    usable = None
    cuts = candidates(cfg, shape, min_a_blocks)
    started = time.monotonic()
    next_word = started + PROGRESS_AFTER_S
    for n, part in enumerate(cuts):
        if time.monotonic() >= next_word:  # a slow box: say it is working
            log.info(
                "planning %s: weighed %d of %d %s cuts (%.0f s)",
                model_name,
                n,
                len(cuts),
                shape,
                time.monotonic() - started,
            )
            next_word += PROGRESS_EVERY_S
        try:
            pl = evaluate(model_name, cfg, part, by_name, workload, sizes)
        except PlanError as e:  # more devices than this cut gives a party blocks
            usable = usable or e
            continue
        a_blocks = part.front + (part.back or 0)
        key = (float(f"{pl.pipelined_time:.12g}"), a_blocks)
        needs.append((part, {p: pl.loads[p].memory_bytes for p in PARTIES}, key))
        if any(pl.loads[p].memory_bytes > by_name[p].memory_bytes for p in PARTIES):
            continue
        if best is None or key < best[0]:
            best = (key, pl)
    if best is None and not needs:
        raise PlanError(f"no {shape} cut of {model_name} can use the devices: {usable}")
    if best is None:
        from aisyn.split.planner.fit import balanced_cut, fewest_devices, no_fit_message

        fit = fewest_devices(sizes, cfg, cuts, by_name, workload)
        closest = balanced_cut(needs)
        raise PlanError(
            no_fit_message(model_name, shape, closest, by_name, workload, fit)
        )
    return best[1]
