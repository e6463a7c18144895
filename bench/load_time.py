"""Load time and peak memory of pretrained weights in each format we read.

Writes one model with random weights (PanGu-α ``350M`` by default, its real
40 000-token vocabulary; ``--model`` takes any preset, ``llama-tiny`` too)
in every format, then loads each in a fresh process, as a user
would start a run from it, and reports:

* wall time from "read the weights" to "a model ready to run", every weight
  read once (imports and process start excluded);
* peak resident memory of that process above what it held after its imports
  (``VmHWM``), against the fp32 weights' own size.

Formats (PanGu-α): our run folder (``model.safetensors``), the PyTorch port's
folder as ``model.safetensors`` and as ``pytorch_model.bin``, and a MindSpore
``.ckpt`` (what ``aisyn convert --from mindspore`` reads). For a GPT-2 / Llama
/ Qwen2 preset: our run folder and a ``save_pretrained``-style folder.

    python bench/load_time.py                    # 350M, every format
    python bench/load_time.py --model llama-tiny --repeats 3

Each format is loaded ``--repeats`` times (median time, max memory); the
page cache is warm after the first, as it is for a user who just wrote the
files. Everything is written under a temporary folder and removed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

LOADERS = {
    # format: Python run in a fresh process; prints {"s": seconds, "rss": bytes}
    "run folder (safetensors)": "load_run",
    "port folder (safetensors)": "load_port",
    "port folder (pytorch_model.bin)": "load_port",
    "MindSpore .ckpt": "load_mindspore",
    "HF folder (safetensors)": "load_hf",
}

CHILD = r"""
import json, sys, time
import torch
from pathlib import Path
import aisyn.model.families, aisyn.train.models, aisyn.model.port, aisyn.model.hf
import aisyn.model.mindspore_ckpt, aisyn.model.mindspore_pangu
kind, where = sys.argv[1], Path(sys.argv[2])
torch.set_num_threads(int(sys.argv[3]))
heads = int(sys.argv[4])
def hwm():  # this process's peak resident memory (VmHWM; ru_maxrss survives exec)
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
before = hwm()
t = time.perf_counter()
from aisyn.model.families import build_model
from aisyn.train.checkpoint import load_weights
if kind == "load_run":
    model, _ = aisyn.train.models.load_run_model(where)
elif kind == "load_port":
    cfg, state = aisyn.model.port.read_port(where)
    model = build_model(cfg, device="meta")
    load_weights(model, state, str(where))
elif kind == "load_hf":
    cfg, state = aisyn.model.hf.read_hf_folder(where)
    model = build_model(cfg, device="meta")
    load_weights(model, state, str(where))
else:
    from aisyn.model.mindspore_pangu import gather_weights, infer_config
    from aisyn.model.mindspore_pangu import is_training_state, to_state_dict
    entries = {str(where): aisyn.model.mindspore_ckpt.read_checkpoint(
        where, keep=lambda n: not is_training_state(n))}
    weights = gather_weights(entries)
    cfg = infer_config(weights, heads)
    model = build_model(cfg, device="meta")
    load_weights(model, to_state_dict(weights, cfg), str(where))
# Read every weight once (as the first forward pass will): safetensors maps
# files lazily, and load time or memory without this would flatter it.
with torch.no_grad():
    total = sum(float(p.float().sum()) for p in model.parameters())
s = time.perf_counter() - t
peak = hwm()
print(json.dumps({"s": s, "rss": peak - before, "params": model.num_parameters()}))
"""


def write_formats(model_name: str, root: Path) -> tuple[dict[str, Path], int, int]:
    """Every format's file or folder for one random model; its fp32 bytes."""
    import torch

    from aisyn.convert import write_base
    from aisyn.model.families import build_model, load_config
    from aisyn.model.hf import HFConfig, write_hf_folder
    from aisyn.model.mindspore_ckpt import write_checkpoint
    from aisyn.model.mindspore_pangu import to_mindspore
    from aisyn.model.port import write_port_folder
    from aisyn.train.checkpoint import unique_state_dict

    cfg = load_config(model_name)
    model = build_model(cfg, seed=0)
    state = unique_state_dict(model)
    size = sum(t.numel() * t.element_size() for t in state.values())
    out = {"run folder (safetensors)": root / "run"}
    write_base(out["run folder (safetensors)"], cfg, state, None, {"format": "bench"})
    if isinstance(cfg, HFConfig):
        (root / "hf").mkdir()
        write_hf_folder(cfg, state, root / "hf")
        out["HF folder (safetensors)"] = root / "hf"
        return out, size, cfg.num_heads
    (root / "port").mkdir()
    write_port_folder(cfg, state, root / "port")
    out["port folder (safetensors)"] = root / "port"
    (root / "port_bin").mkdir()
    write_port_folder(cfg, state, root / "port_bin")
    (root / "port_bin" / "model.safetensors").unlink()
    torch.save(state, root / "port_bin" / "pytorch_model.bin")
    out["port folder (pytorch_model.bin)"] = root / "port_bin"
    write_checkpoint(root / "model.ckpt", to_mindspore(state, cfg))
    out["MindSpore .ckpt"] = root / "model.ckpt"
    return out, size, cfg.num_heads


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="350M")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="aisyn-load-") as tmp:
        t = time.perf_counter()
        formats, size, heads = write_formats(args.model, Path(tmp))
        print(
            f"{args.model}: fp32 weights {size / 2**20:.0f} MiB, written in "
            f"{len(formats)} formats in {time.perf_counter() - t:.0f} s",
            file=sys.stderr,
        )
        print(f"| format ({args.model}) | load time | peak memory above imports |")
        print("|---|---|---|")
        for name, where in formats.items():
            runs = []
            for _ in range(args.repeats):
                proc = subprocess.run(
                    [
                        sys.executable,
                        "-c",
                        CHILD,
                        LOADERS[name],
                        str(where),
                        str(args.threads),
                        str(heads),
                    ],
                    capture_output=True,
                    text=True,
                    check=False,
                )
                if proc.returncode:
                    raise SystemExit(f"{name}: {proc.stderr.strip().splitlines()[-1]}")
                runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
            s = statistics.median(r["s"] for r in runs)
            rss = max(r["rss"] for r in runs)
            print(
                f"| {name} | {s:.2f} s | {rss / 2**20:.0f} MiB "
                f"({rss / size:.2f}x the weights) |"
            )


if __name__ == "__main__":
    main()
