"""A federated client's local steps on several data-parallel ranks.

``aisyn fl client --client-ranks N`` (and ``aisyn fl simulate --client-ranks
N``, for every simulated client) runs each round's E local steps on N ranks:
the ClientApp process checks the global model and scores it as before, then
starts ``torchrun --nproc-per-node N -m aisyn.fl.ranks FOLDER`` (a
``procs.ChildProcess``: its own process group, ended with the client) on
127.0.0.1 and a free port. Every rank is the local executor under the one
regime (``fl.client.local_steps``) with DDP (gloo on CPU, NCCL on GPU; its
``train.distributed`` context): all draw the same global batch, each keeps
its contiguous share of the rows, each share's loss is over the whole batch's
answer tokens, so a step computes what one process would on the whole batch.

Nothing crosses by pickle: the global model goes to the ranks as a
safetensors file and the trained tensors come back as one (rank 0 writes
it), beside a JSON job and result, in a private temporary folder (mode 0700)
in the client's run folder, removed after the round. The update then leaves
the client once, as a single-rank client's does.

A rank that dies (or hangs) fails the round: torchrun ends the other ranks
when one exits, collectives time out after the round timeout, and the client
stops waiting after it too; the client's train reply is then an error with one
line naming the failure and the ranks' log, which the server rejects like any
failed client (its global model is untouched).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
from flwr.app import ConfigRecord
from safetensors.torch import save_file

from aisyn import procs
from aisyn.net import free_port
from aisyn.procs import ChildProcess, child_env
from aisyn.train import checkpoint as ckpt

JOB_FILE = "job.json"
GLOBAL_FILE = "global.safetensors"
TRAINED_FILE = "trained.safetensors"
RESULT_FILE = "result.json"
RANKS_LOG = "ranks.log"  # in the client's run folder (appended each round)


class RanksFailed(RuntimeError):
    """The client's training ranks did not finish the round."""


def train_on_ranks(
    ctx, config: ConfigRecord, anchor: dict[str, torch.Tensor], timeout: float
) -> tuple[dict[str, torch.Tensor], float, float]:
    """The round's local steps of ``ctx`` (a ``fl.client.ClientContext`` holding
    the global model ``anchor``) on ``ctx.node.ranks`` ranks; returns the
    trained tensors, the mean loss and the training seconds."""
    node = ctx.node
    ranks = node.ranks
    batch = ctx.settings.train.batch_size
    if batch % ranks:
        raise ValueError(
            f"client {node.name}: batch-size {batch} does not split into "
            f"{ranks} ranks (--client-ranks)"
        )
    folder = Path(tempfile.mkdtemp(prefix="ranks-", dir=node.out))  # mode 0700
    proc = None
    try:
        save_file(
            {
                k: v.detach().to("cpu", torch.float32).contiguous()
                for k, v in anchor.items()
            },
            str(folder / GLOBAL_FILE),
        )
        job = {
            "node": node.to_node_config(),
            "config": {k: v for k, v in dict(config).items()},
            "timeout": timeout,
        }
        (folder / JOB_FILE).write_text(json.dumps(job), encoding="utf-8")
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes",
            "1",
            "--nproc-per-node",
            str(ranks),
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(free_port()),
            "--monitor-interval",
            "0.5",
            "-m",
            "aisyn.fl.ranks",
            str(folder),
        ]
        log_path = node.out / RANKS_LOG
        offset = log_path.stat().st_size if log_path.exists() else 0
        t0 = time.perf_counter()
        proc = ChildProcess(f"client {node.name} ranks", cmd, log_path, env=child_env())
        try:
            rc = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise RanksFailed(
                f"client {node.name}: its {ranks} training ranks did not finish "
                f"within {timeout:g} s (log: {log_path})"
            ) from None
        if rc != 0 or not (folder / RESULT_FILE).is_file():
            raise RanksFailed(
                f"client {node.name}: a training rank failed (torchrun exit "
                f"{rc}) after {time.perf_counter() - t0:.1f} s: "
                f"{_first_error(log_path, offset)} (log: {log_path})"
            )
        result = json.loads((folder / RESULT_FILE).read_text(encoding="utf-8"))
        trained = ckpt.read_tensors(folder / TRAINED_FILE)
        if {k: tuple(v.shape) for k, v in trained.items()} != ctx.spec:
            raise RanksFailed(
                f"client {node.name}: its ranks' tensors are not the model's"
            )
        return trained, float(result["mean_loss"]), float(result["train_s"])
    finally:
        if proc is not None and proc.alive():
            proc.stop()
        shutil.rmtree(folder, ignore_errors=True)


def _first_error(log_path: Path, offset: int) -> str:
    """What went wrong, on one line, from what this round wrote to the ranks'
    log (from ``offset``): torchrun's root cause (which rank, how it ended),
    else the first error line."""
    try:
        with log_path.open("rb") as f:
            f.seek(offset)
            lines = f.read().decode(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    for i, line in enumerate(lines):
        if line.startswith("Root Cause"):
            fields = dict(
                (k.strip(), v.strip())
                for k, _, v in (x.partition(":") for x in lines[i + 1 : i + 9])
                if v
            )
            if "rank" in fields:
                return (
                    f"rank {fields['rank'].split()[0]} ended with exit code "
                    f"{fields.get('exitcode', '?')}"
                    + (f", {fields['traceback']}" if "traceback" in fields else "")
                )
    for line in lines:
        if "Error" in line:
            return " ".join(line.split())[:300]
    return " ".join((lines[-1] if lines else "(no output)").split())[:300]


def main(argv: list[str] | None = None) -> int:
    """One rank (under torchrun): train the round's share, rank 0 writes back."""
    from aisyn.fl.client import ClientContext, ClientNode, local_steps
    from aisyn.fl.round_message import settings_from_record
    from aisyn.train import distributed
    from aisyn.train.config import per_rank_micro_batches
    from aisyn.train.device import resolve_device
    from aisyn.train.lora import load_trainable, trainable_tensors
    from aisyn.validate import name_differences

    procs.end_with_parent()  # a rank never outlives its torchrun agent
    folder = Path((argv or sys.argv[1:])[0])
    job = json.loads((folder / JOB_FILE).read_text(encoding="utf-8"))
    node = ClientNode.from_node_config(job["node"])
    settings, fingerprint, server_round = settings_from_record(
        ConfigRecord(job["config"])
    )
    dist, device = distributed.setup(
        resolve_device(settings.train.device), timeout=timedelta(seconds=job["timeout"])
    )
    try:
        ctx = ClientContext(
            node, settings, fingerprint, device=device, main=dist.is_main
        )
        # (ctx.settings: this client's own steps under --local-epochs)
        cfg = per_rank_micro_batches(ctx.settings.train, dist.world)
        anchor = {
            k: v.to(device) for k, v in ckpt.read_tensors(folder / GLOBAL_FILE).items()
        }
        if diff := name_differences(ctx.spec, anchor.keys(), more=True):
            raise ValueError(f"global model file: tensor names differ ({diff})")
        load_trainable(ctx.trainable, anchor)
        mean_loss, train_s = local_steps(ctx, server_round, anchor, dist, cfg)
        if dist.is_main:
            trained = {
                k: v.detach().to("cpu", torch.float32).contiguous()
                for k, v in trainable_tensors(ctx.trainable).items()
            }
            save_file(trained, str(folder / TRAINED_FILE))
            (folder / RESULT_FILE).write_text(
                json.dumps({"mean_loss": mean_loss, "train_s": train_s}),
                encoding="utf-8",
            )
        dist.barrier()
    except BaseException:
        distributed.teardown(dist)
        raise
    # Done: the process group ends with the process (``procs.exit_rank``),
    # whose teardown is where ranks were seen to abort now and then.
    return 0


if __name__ == "__main__":
    procs.exit_rank(main())
