"""SplitFed for a consortium: N data parties, one shared backbone at the
compute party, the parties' own segments averaged by a Flower strategy.

Each party keeps its embedding, front, back and head (``splitfed.member``)
and its data; the compute party keeps one backbone that every party's steps
train (``split.centre.consortium``: SFLV2, the parties' steps taken one after
another). Every ``local_steps`` steps the parties' segments are averaged by
the strategy the federated regime uses (``fl.strategy.make_strategy``:
FedAvg, FedProx, FedAdam, FedAvgM, the robust aggregations and client DP,
each update guarded), run by the federation's round loop (``fl.federation``)
over a grid whose nodes are the parties in this process. A consortium stopped
after round k resumes (``resume=True``) at round k + 1: the global segments,
the strategy's state and random states (``fl.federation``), the backbone
(B's checkpoint of the round, its bound's history), each party's optimizer,
random state and data position (its checkpoint of the round) -- and ends
where an uninterrupted run ends, bit for bit.

Here every party and the compute party run in one process, joined by
in-memory links: the comparison's regime (``aisyn experiment compare``), with
exactly what would cross a network counted. Secure aggregation does not apply
in one process (the process that averages sees every update anyway) and is
refused, as is chunking.

A party whose step fails -- its cut tensors not finite (its step skipped on
both sides), or out of the bound the backbone keeps on them
(``split.centre.consortium``: its session ended by B) -- is dropped from the
consortium: its reply to the round is an error, which the strategy's guard
rejects in one line naming the party, its session ends, and every later
round it is left out the same way. The honest parties' run goes on to its
result.

Run folder::

    OUT/config.json, metrics.jsonl    the consortium: one line per round
    OUT/loss.png, result.json
    OUT/global/                       the averaged segments (a split data
                                      party's folder, one checkpoint a round)
    OUT/compute/<consortium id>/      the shared backbone (B's run folder)
    OUT/merged/                       both as one plain model (split merge)
    OUT/parties/<name>/               each party's own run: its local steps,
                                      metrics and last segments
"""

from __future__ import annotations

import contextlib
import logging
import re
import secrets
import shutil
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from flwr.app import (
    ArrayRecord,
)

from aisyn.fl.federation import FEDERATION_FILE, Federation
from aisyn.fl.guard import norm_bound
from aisyn.fl.launch import check_client
from aisyn.fl.records import payload_bytes, record_to_tensors, tensors_to_record
from aisyn.fl.round_message import round_config, setting_differences
from aisyn.fl.settings import FLSettings
from aisyn.fl.strategy import make_strategy
from aisyn.link.memory import memory_pair
from aisyn.model.segments import DATA_PARTY, parse_partition
from aisyn.split import protocol as proto
from aisyn.split.backbone.compute_party import ComputeParty
from aisyn.split.centre.consortium import SharedBackbone
from aisyn.split.client.merge import merge
from aisyn.split.defence.cut_dp import CutDefence
from aisyn.split.party import PartyState, compute_lora_hello, open_base, place_weights
from aisyn.split.session import SplitOptions, failure_reason
from aisyn.split.transport import link_options
from aisyn.splitfed.grid import MembersGrid, flower_task
from aisyn.splitfed.member import Member, ProximalSession
from aisyn.train import checkpoint as ckpt
from aisyn.train.config import TrainConfig
from aisyn.train.device import resolve_device
from aisyn.train.models import BaseModel, describe_base
from aisyn.train.objective import SFTObjective
from aisyn.train.run import TOKENIZER, RunDir, write_json_atomic

log = logging.getLogger("aisyn.splitfed")

RESULT_FILE = "result.json"
#: a party's name: its folder under OUT/parties/
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.+-]{0,63}")


def default_cut(num_blocks: int) -> str:
    """One block on each party's side at each end where the model has the
    blocks for it (the comparison's split and SplitFed regimes both)."""
    return "u:1,1" if num_blocks >= 3 else "u:1,0"


def check_settings(settings: FLSettings, members: Mapping[str, Path]) -> None:
    """Refuse, in one line each, what SplitFed in one process cannot do."""
    if len(members) < 1:
        raise ValueError("splitfed needs at least one data party")
    for name in members:
        if not _NAME.fullmatch(name):
            raise ValueError(
                f"party name {name!r}: letters, digits and _ . + - only, "
                "starting with a letter or digit (it names the party's folder)"
            )
    if settings.secure_aggregation:
        raise ValueError(
            "splitfed: secure aggregation does not apply where every party runs "
            "in one process (that process sees each update anyway); run without it"
        )
    if settings.max_message_mb:
        raise ValueError("splitfed: --max-message-mb (chunked updates) does not apply")
    if settings.local_epochs:
        raise ValueError(
            "splitfed: every party takes local-steps steps on the shared "
            "backbone's schedule: set local-epochs 0"
        )
    if settings.schedule != "continue":
        raise ValueError(
            "splitfed: schedule must be 'continue' (the shared backbone's "
            "schedule runs on over every round)"
        )
    if settings.min_clients != len(members):
        raise ValueError(
            f"splitfed: min-clients is {settings.min_clients} but {len(members)} "
            "parties are given"
        )


def run_splitfed(
    base: str | Path,
    parties: Mapping[str, str | Path],
    out: str | Path,
    settings: FLSettings,
    *,
    cut: str | None = None,
    window: int = 0,
    codec: str = "none",
    log_every: int = 10,
    resume: bool = False,
) -> dict:
    """Train the consortium of ``parties`` (name -> SFT folder) from ``base``
    for ``settings.rounds`` rounds of ``settings.local_steps`` steps per party;
    returns the summary also written to ``OUT/result.json``. ``resume``:
    continue the consortium in ``out`` from its last finished round (the
    global segments, the backbone, each party's optimizer and data position,
    the strategy's state), ending where an uninterrupted run ends.

    Every party and the backbone use ``settings.method`` (full or LoRA). The
    shared backbone takes ``rounds x local_steps x parties`` steps, each party
    ``rounds x local_steps``: the budget of the federated regime's clients.
    ``log_every``: each party's metrics record every that many steps (and
    the first and last of each round).
    """
    t_start = time.perf_counter()
    members_data = {n: Path(d) for n, d in parties.items()}
    check_settings(settings, members_data)
    out = Path(out)
    if (out / "config.json").exists() and not resume:
        raise FileExistsError(
            f"{out}: already holds a run; pass resume to continue it or choose "
            "another --out"
        )
    info = describe_base(base)
    for name, data in members_data.items():
        check_client(name, data, info.path, role="party")
    mcfg = info.model
    cut = cut or default_cut(mcfg.num_blocks)
    partition = parse_partition(cut, mcfg)
    if not partition.is_u_shape:
        raise ValueError(f"--cut {cut}: SplitFed needs a U-shape cut (u:FRONT,BACK)")
    method = settings.method_spec()
    a_cfg = settings.train  # its steps: rounds x local steps (FLSettings)
    b_cfg = replace(a_cfg, steps=a_cfg.steps * len(members_data))
    device = resolve_device(a_cfg.device)
    a_base = open_base(info.checkpoint, mcfg, partition, DATA_PARTY)
    consortium = time.strftime("%Y%m%d-%H%M%S-") + secrets.token_hex(4)
    opts = SplitOptions(cut=cut, mode="local", window=window, codec=codec)
    config = {
        "kind": "splitfed",
        "run_id": consortium,
        "model": mcfg.to_dict(),
        "partition": partition.to_dict(),
        "parties": {n: str(d.resolve()) for n, d in members_data.items()},
        "splitfed": settings.to_dict(),
        "split": opts.record(),
        "base": info.to_dict(),
        "tokenizer": info.tokenizer,
        "seq_len": mcfg.seq_len,
    }
    saved: dict = {}
    if resume:
        config["run_id"] = consortium = _resumable(out, config)
        saved = _saved_round(out / "global")
    party = ComputeParty(
        mcfg, partition, out / "compute", device=a_cfg.device, init_from=info.checkpoint
    )

    def hello(run_id: str, cfg, resume=False, a_steps=()) -> str:
        return proto.encode_json(
            proto.hello(
                purpose="train",
                run_id=run_id,
                model=mcfg.to_dict(),
                partition=partition.to_dict(),
                train=cfg,
                lora=compute_lora_hello(mcfg, partition, method, cfg.seed),
                resume=resume,
                a_steps=list(a_steps),
                codec=codec,
                init=a_base.fingerprint,
            )
        )

    b_step = saved.get("step", 0)
    _, b_session = party.negotiate(
        hello(consortium, b_cfg, resume, [b_step] if b_step else []), "consortium"
    )
    root = RunDir(out)
    root.start(config, resume=resume, tokenizer=info.path / TOKENIZER)
    # the federated guard's bound on updates, here on each member's cut tensors
    backbone = SharedBackbone(party, b_session, norm_bound, settings.max_norm_ratio)
    if saved:
        backbone.restore(saved["splitfed"]["backbone"])
    global_run = RunDir(out / "global")
    global_run.start(
        _data_party_config(
            consortium, config, a_cfg, opts, list(members_data.values()), a_base
        ),
        resume=resume,
        tokenizer=info.path / TOKENIZER,
    )
    shared = Shared(
        out, config, consortium, party, backbone, hello, a_cfg, opts, device,
        a_base, settings, log_every, resume,
        saved.get("round", 0) * settings.local_steps,
    )  # fmt: skip
    with contextlib.ExitStack() as stack:
        members = {
            node: stack.enter_context(_member(shared, name, node, data))
            for node, (name, data) in enumerate(members_data.items(), start=1)
        }
        summary = _federate(
            root, global_run, members, backbone, settings, info, t_start, resume
        )
    merged = out / "merged"
    # derived from the two halves: a resumed run (even a finished one) merges again
    shutil.rmtree(merged, ignore_errors=True)
    merge(global_run.path, out / "compute", merged)
    summary["merged"] = str(merged)
    summary["elapsed_s"] = time.perf_counter() - t_start
    write_json_atomic(root.path / RESULT_FILE, summary)
    root.close()
    return summary


def _resumable(out: Path, config: dict) -> str:
    """The consortium ID of the run in ``out`` that ``config`` continues;
    refuses in one line a folder that holds no SplitFed run, or one of other
    parties, cut, base or settings."""
    try:
        old = RunDir(out).read_config()
    except FileNotFoundError:
        raise ValueError(f"resume: {out} holds no SplitFed run") from None
    if old.get("kind") != "splitfed" or not isinstance(old.get("run_id"), str):
        raise ValueError(f"resume: {out} is not a SplitFed run")
    for key, what in (
        ("parties", "parties"),
        ("partition", "cut"),
        ("model", "model"),
        ("split", "split options"),
    ):
        if old.get(key) != config[key]:
            raise ValueError(f"resume: {out} was started with other {what}")
    if (old.get("base") or {}).get("fingerprint") != config["base"]["fingerprint"]:
        raise ValueError(f"resume: {out} was started from another base model")
    differ = setting_differences(old.get("splitfed"), config["splitfed"])
    if differ:
        raise ValueError(
            f"resume: {out} was started with other settings ({', '.join(differ)})"
        )
    return old["run_id"]


def _saved_round(global_dir: Path) -> dict:
    """The state of the consortium's last saved round ({}: none was)."""
    folder = ckpt.latest(global_dir / "checkpoints")
    if folder is None:
        return {}
    state = ckpt.read_state(folder)
    record = state.get("splitfed")
    if (
        not isinstance(record, dict)
        or not isinstance(record.get("backbone"), dict)
        or not isinstance(record.get("dropped"), dict)
        or not isinstance(state.get("round"), int)
        or not isinstance(state.get("step"), int)
    ):
        raise ckpt.CheckpointError(
            f"{folder}: holds no consortium state (not a SplitFed checkpoint, or "
            "one from before resume existed)"
        )
    # read through before anything is written (the federation checks the rest)
    ckpt.read_tensors(folder / FEDERATION_FILE)
    return state


def _data_party_config(
    run_id: str, config: dict, cfg, opts: SplitOptions, data: list[Path], base
) -> dict:
    """The global segments' folder as a split data party's (what ``aisyn
    split merge`` and ``aisyn split eval`` read), for the consortium's run."""
    method = FLSettings.from_dict(config["splitfed"]).method_spec().to_dict()
    return {
        "kind": "split",
        "party": DATA_PARTY,
        "run_id": run_id,
        "model": config["model"],
        "partition": config["partition"],
        "train": cfg.to_dict(),
        "split": opts.record(),
        "objective": SFTObjective.name,
        "data": [str(d.resolve()) for d in data],
        "tokenizer": config["tokenizer"],
        "seq_len": config["seq_len"],
        "init_from": str(base.checkpoint),
        "method": method,
        "compute_method": method,
        "cut_defence": CutDefence().to_dict(),
        "world_size": 1,
        "splitfed": {"consortium": run_id, "averaged": True},
    }


@dataclass
class Shared:
    """What every party of the consortium is set up from."""

    out: Path
    config: dict
    consortium: str
    party: ComputeParty
    backbone: SharedBackbone
    hello: Callable[[str, TrainConfig], str]
    cfg: TrainConfig
    opts: SplitOptions
    device: torch.device
    base: BaseModel
    settings: FLSettings
    log_every: int
    #: a resumed consortium, and each party's step it resumes from (0: none)
    resuming: bool = False
    resume_step: int = 0


@contextlib.contextmanager
def _member(c: Shared, name: str, node: int, data: Path) -> Iterator[Member]:
    """Party ``name``'s data party, its session with the shared backbone
    (B's rounds on a thread of their own) open for the whole run."""
    run_id = f"{c.consortium}-p{node}"
    run = RunDir(c.out / "parties" / name)
    run.start(
        {
            **_data_party_config(run_id, c.config, c.cfg, c.opts, [data], c.base),
            "kind": "splitfed-party",
            "splitfed": {"consortium": c.consortium, "party": name},
        },
        resume=c.resuming,
        tokenizer=Path(c.config["base"]["path"]) / TOKENIZER,
    )
    party, cfg, codec = c.party, c.cfg, c.opts.codec
    state = PartyState(
        party.cfg,
        party.partition,
        DATA_PARTY,
        cfg,
        c.device,
        method=c.settings.method_spec(),
    )
    place_weights(state, c.base, None, fresh_train=True)
    objective = SFTObjective([data], cfg)
    objective.start(c.device)
    # in one process: no receive waits out a timeout (a party that fails
    # closes its end, and B's thread ends with it)
    link_a, link_b = memory_pair(codec, options=link_options(codec, None))
    _, session = party.negotiate(c.hello(run_id, cfg), link_b.peer.identity)
    errors: list[BaseException] = []

    def serve() -> None:
        try:
            c.backbone.serve(link_b, session, name, c.resume_step)
        except BaseException as e:  # reported to the party through the link
            errors.append(e)
            log.debug("party %s: the backbone's rounds failed", name, exc_info=True)
            link_b.abort(failure_reason(e))
        finally:
            link_b.close()

    thread = threading.Thread(target=serve, name=f"backbone-{name}", daemon=True)
    thread.start()
    try:
        member = Member(
            name,
            node,
            data,
            run,
            state,
            ProximalSession(state, link_a, eod_id=None, window=c.opts.window),
            objective,
            c.base,
            c.settings.local_steps,
            c.settings.eval_items,
            c.log_every,
        )
        if c.resuming:
            member.resume(c.resume_step)
        yield member
    except Exception as e:
        link_a.close()
        thread.join(30)
        if errors and e is not errors[0]:
            raise errors[0] from e  # B's reason says more than a closed link
        raise
    finally:
        link_a.close()
        thread.join(30)
        run.plot(f"party {name}")
        run.close()


def _federate(
    root: RunDir,
    global_run: RunDir,
    members: dict[int, Member],
    backbone: SharedBackbone,
    settings: FLSettings,
    info,
    t_start: float,
    resume: bool = False,
) -> dict:
    """The federation's rounds over the parties; a checkpoint of the global
    segments and of the backbone after every round (``resume``: from the
    last one)."""
    first = members[min(members)]
    #: the link bytes of the rounds before a resume (its links are new)
    link_before = 0

    def link_bytes() -> int:
        return link_before + sum(
            m.link.bytes_sent + m.link.bytes_received for m in members.values()
        )

    def describe(server_round: int, arrays: ArrayRecord, entry: dict) -> None:
        # the parties that took this round (not one dropped in it or before)
        rounds = [
            m.rounds[-1]
            for m in members.values()
            if m.rounds and m.rounds[-1]["round"] == server_round
        ]
        entry.update(
            step=backbone.step,
            skipped_backbone_steps=backbone.skipped,
            link_bytes=sum(
                r["link_bytes_sent"] + r["link_bytes_received"] for r in rounds
            ),
            train_loss=(
                sum(r["round_loss"] for r in rounds) / len(rounds) if rounds else None
            ),
            elapsed_s=time.perf_counter() - t_start,
        )

    def checkpoint(server_round: int, arrays: ArrayRecord, files, state) -> None:
        step = backbone.step
        backbone.save()
        tensors = record_to_tensors(arrays, first.spec)
        weights = {**first.state.weights(), **tensors}
        ckpt.save(
            global_run.checkpoints,
            step,
            {
                ckpt.MODEL_FILE: weights,
                ckpt.OPTIM_FILE: ckpt.rng_tensors(),  # no one optimizer's
                **files,
            },
            {
                **state,
                "splitfed": {
                    "backbone": backbone.record(),
                    "dropped": {m.name: m.dropped for m in members.values()},
                    "link_bytes": link_bytes(),
                },
                "party": DATA_PARTY,
                "run_id": global_run.read_config()["run_id"],
                "step": step,
                "model": first.state.cfg.to_dict(),
                "partition": first.state.partition.to_dict(),
                "train": first.state.train_cfg.to_dict(),
            },
            keep=2,
        )

    initial = tensors_to_record(first.segments())
    federation = Federation(
        make_strategy(settings),
        MembersGrid(members),
        settings,
        round_config(settings, info),
        root,
        first.spec,
        describe,
        checkpoint,
    )
    start, arrays = 1, None
    if resume:
        federation.checkpoints = global_run.checkpoints
        start, arrays = federation.resume()
        if start > 1:
            record = federation.saved_state["splitfed"]
            link_before = int(record["link_bytes"])
            for m in members.values():
                if record["dropped"].get(m.name):
                    m.drop(record["dropped"][m.name])
    with flower_task(run_id=1):
        final = federation.run_rounds(arrays or initial, start)
    history = federation.history
    segment_bytes = payload_bytes(initial)
    resumed = {"resumed_at_round": start} if start > 1 else {}
    return {
        **resumed,
        "status": "completed",
        "rounds": settings.rounds,
        "local_steps": settings.local_steps,
        "parties": {m.name: str(m.run.path) for m in members.values()},
        # party -> why it was left out of the rounds from the one named on
        "dropped": {m.name: m.dropped for m in members.values() if m.dropped},
        "settings": settings.to_dict(),
        "history": history,
        "final_global_valid_loss": final,
        "backbone_steps": backbone.step,
        "skipped_backbone_steps": backbone.skipped,
        "train_s": sum(r["train_s"] for m in members.values() for r in m.rounds),
        # cut activations and gradients, every party with the compute party
        "link_bytes": link_bytes(),
        # the segments each way, every party, every round (Flower's payload)
        "segment_bytes_per_party_round": segment_bytes,
        "segment_bytes": 2 * segment_bytes * len(members) * settings.rounds,
        "trainable_parameters_per_party": sum(
            p.numel() for p in first.trainable.values()
        ),
        "backbone": str(backbone.party.run_dir(backbone.session.run_id).path),
        "global": str(global_run.path),
        "run": str(root.path),
    }
