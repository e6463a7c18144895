"""What the federated server does, as plain functions (the Flower handler in
``server_app.py`` only reads the run config and calls ``run_server``).

Hold the global trainable tensors, run a guarded Flower strategy for R rounds
(``fl.federation``'s loop, resumable), and after every round write the global
model atomically as a checkpoint and one line of ``metrics.jsonl``.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

from flwr.app import ArrayRecord
from flwr.serverapp import Grid

from aisyn.accountant import finite_or_none
from aisyn.fl import chunked_grid, chunks
from aisyn.fl.dp import sample_rate, settings_epsilon
from aisyn.fl.federation import Federation
from aisyn.fl.node import build_trainable, start_run
from aisyn.fl.records import (
    payload_bytes,
    record_to_tensors,
    tensors_to_record,
)
from aisyn.fl.round_message import (
    RESULT_FILE,
    round_config,
    setting_differences,
)
from aisyn.fl.secure import SecAggPlusGrid
from aisyn.fl.settings import FLSettings
from aisyn.fl.strategy import guard_of, make_strategy
from aisyn.train.executor import save_model
from aisyn.train.lora import load_trainable, trainable_tensors
from aisyn.train.models import BaseModel, describe_base
from aisyn.train.run import RunDir, write_json_atomic

log = logging.getLogger("aisyn.fl")


@dataclass
class ServerNode:
    base: Path
    out: Path
    #: continue the run in ``out`` from its last finished round
    resume: bool = False


def server_run_config(settings: FLSettings, node: ServerNode) -> dict:
    return {
        **settings.to_run_config(),
        "base": str(node.base),
        "out": str(node.out),
        "resume": node.resume,
    }


def check_resumable(run: RunDir, settings: FLSettings, base: BaseModel) -> None:
    """Refuse, in one line, to resume a server folder that holds no run, or a
    run of other settings or another base model (before anything is written)."""
    try:
        old = run.read_config()
    except FileNotFoundError:
        raise ValueError(f"--resume: {run.path} holds no federated run") from None
    if old.get("role") != "server" or not isinstance(old.get("federated"), dict):
        raise ValueError(f"--resume: {run.path} is not a federated server's run")
    if (old.get("base") or {}).get("fingerprint") != base.fingerprint:
        raise ValueError(
            f"--resume: {run.path} was started from another base model than {base.path}"
        )
    saved, now = old["federated"], settings.to_dict()
    differ = setting_differences(saved, now)
    if differ:
        shown = ", ".join(f"{k} {saved.get(k)!r} -> {now.get(k)!r}" for k in differ)
        raise ValueError(f"--resume: the run was started with other settings ({shown})")


def run_server(settings: FLSettings, node: ServerNode, grid: Grid) -> dict:
    """Run the federation over ``grid`` (with ``node.resume``: from the last
    round ``node.out`` finished); returns the summary also written to
    ``OUT/result.json``."""
    t_start = time.perf_counter()
    info = describe_base(node.base)
    run = RunDir(node.out)
    if node.resume:
        check_resumable(run, settings, info)
    model, trainable, spec = build_trainable(info, settings, "cpu")
    initial = tensors_to_record(trainable_tensors(trainable))
    plan = chunks.plan_for(settings, spec)  # None: the model fits one message
    strategy = make_strategy(settings)
    guard = guard_of(strategy)
    secure = SecAggPlusGrid(grid, settings) if settings.secure_aggregation else None

    def describe(server_round: int, arrays: ArrayRecord, entry: dict) -> None:
        if secure is not None:
            entry["secure_aggregation"] = secure.last_round
        if settings.dp != "off":
            eps = settings_epsilon(settings, server_round)
            entry["epsilon"] = finite_or_none(eps)
            log.info(
                "round %d: client DP epsilon %.4g at delta %g",
                server_round,
                eps,
                settings.dp_delta,
            )
        entry["step"] = server_round * settings.local_steps
        entry["elapsed_s"] = time.perf_counter() - t_start

    def checkpoint(server_round: int, arrays: ArrayRecord, files, state) -> None:
        load_trainable(trainable, record_to_tensors(arrays, spec))
        save_model(
            run,
            model,
            server_round * settings.local_steps,
            {**state, "elapsed_s": time.perf_counter() - t_start},
            keep=2,
            adapters=settings.method == "lora",
            files=files,
        )

    federation = Federation(
        strategy,
        grid,
        settings,
        round_config(settings, info),
        run,
        spec,
        describe,
        checkpoint,
    )
    first, arrays = federation.resume() if node.resume else (1, None)
    start_run(
        run,
        settings,
        info,
        role="server",
        seq_len=info.model.seq_len,
        resume=node.resume,
    )
    if settings.tensorboard:
        run.enable_tensorboard()
    if plan is not None:
        guard.chunked = chunked_grid.ChunkedGrid(
            secure or grid,
            spec,
            plan,
            chunks.limit_bytes(settings.max_message_mb),
            run.path / chunks.STAGING,
        )
        log.info(
            "the model travels in %d chunks of at most %d bytes",
            len(plan),
            chunks.limit_bytes(settings.max_message_mb),
        )
    federation.grid = guard.chunked or secure or grid
    final = federation.run_rounds(arrays or initial, first)
    summary = {
        "status": "completed",
        "rounds": settings.rounds,
        "local_steps": settings.local_steps,
        "settings": settings.to_dict(),
        "history": federation.history,
        "final_global_valid_loss": final,
        "elapsed_s": time.perf_counter() - t_start,
        "trainable_parameters": sum(p.numel() for _, p in trainable),
        "payload_bytes_per_client": payload_bytes(initial),
        "chunks": len(plan) if plan else 1,
        "run": str(run.path),
        "privacy": privacy_summary(settings),
    }
    if first > 1:
        summary["resumed_at_round"] = first
    write_json_atomic(run.path / RESULT_FILE, summary)
    run.close()
    log.info(
        "federated run finished: %s",
        json.dumps(
            {
                k: summary[k]
                for k in ("rounds", "final_global_valid_loss", "elapsed_s", "privacy")
            }
        ),
    )
    return summary


def privacy_summary(settings: FLSettings) -> dict:
    """What protected the clients' updates in this run, and client DP's ε."""
    out: dict = {"secure_aggregation": settings.secure_aggregation, "dp": settings.dp}
    if settings.secure_aggregation:
        out["secagg_threshold"] = settings.secagg_quorum
        out["secagg_clipping_range"] = settings.secagg_clipping_range
    if settings.dp != "off":
        eps = settings_epsilon(settings, settings.rounds)
        out.update(
            {
                "epsilon": finite_or_none(eps),
                "delta": settings.dp_delta,
                "noise_multiplier": settings.dp_noise_multiplier,
                "clipping_norm": settings.dp_clipping_norm,
                "sampled_clients": settings.sampled_clients,
                "sample_rate": sample_rate(settings),
                "accountant": "RDP (dp_accounting), all rounds counted",
            }
        )
    return out
