"""The run folder every command writes: config, metrics, checkpoints, plots.

``RUN/config.json``      what was run (model, training, data, tokenizer)
``RUN/metrics.jsonl``    one JSON object per logged step
``RUN/loss.png``         the loss curve
``RUN/checkpoints/``     see ``checkpoint.py``
``RUN/tokenizer.model``  the tokenizer the data was made with (for evaluation)

Standalone, split, federated and experiment runs share this shape, so plotting
and evaluation work on all of them.
"""

from __future__ import annotations

import csv
import json
import os
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path

from aisyn.validate import read_json

CONFIG = "config.json"
METRICS = "metrics.jsonl"
PLOT = "loss.png"
TOKENIZER = "tokenizer.model"


#: sub-folder that TensorBoard event files go to (``--tensorboard``)
TENSORBOARD_DIR = "tensorboard"


class RunDir:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._tensorboard = None  # a SummaryWriter once enabled

    @property
    def checkpoints(self) -> Path:
        return self.path / "checkpoints"

    @property
    def metrics_path(self) -> Path:
        return self.path / METRICS

    def create(self, config: dict, *, resume: bool) -> None:
        """Make the folder; refuse to reuse one that holds a run unless resuming."""
        has_run = (self.path / CONFIG).is_file()
        if has_run and not resume:
            raise FileExistsError(
                f"{self.path}: already holds a run; pass --resume to continue it "
                "or choose another --out"
            )
        if resume and has_run:
            self.check_same_model(config)
        self.path.mkdir(parents=True, exist_ok=True)
        write_json_atomic(self.path / CONFIG, config)

    def start(self, config: dict, *, resume: bool, tokenizer: Path) -> None:
        """``create`` the folder and copy in the data's ``tokenizer``."""
        self.create(config, resume=resume)
        self.copy_tokenizer(tokenizer)

    def check_same_model(self, config: dict) -> None:
        """Refuse to resume this run with another model than it was started with."""
        old = self.read_config()
        if "model" in config and old.get("model") != config["model"]:
            raise ValueError(
                f"{self.path}: --resume with a different model than the run "
                f"was started with ({old.get('model')} vs {config['model']})"
            )

    def read_config(self) -> dict:
        path = self.path / CONFIG
        if not path.is_file():
            raise FileNotFoundError(f"{self.path}: not a run folder (no {CONFIG})")
        try:  # a base run may come from another organisation: bounded
            return read_json(path)
        except ValueError as e:
            raise ValueError(f"corrupt run config: {e}") from None

    def copy_tokenizer(self, src: Path) -> None:
        dst = self.path / TOKENIZER
        if not dst.exists():
            shutil.copyfile(src, dst)

    def log_metrics(self, record: dict) -> None:
        """Append ``record`` to metrics.jsonl (and, once enabled, its numbers to
        TensorBoard at its ``step``, or ``round`` for a federated server)."""
        with self.metrics_path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
        if self._tensorboard is not None:
            at = record.get("step", record.get("round"))
            if isinstance(at, int):
                for key, value in record.items():
                    if key not in ("step", "round") and isinstance(value, int | float):
                        self._tensorboard.add_scalar(key, value, at)
                self._tensorboard.flush()  # a killed run keeps what it logged

    def enable_tensorboard(self) -> None:
        """Mirror every metrics record to TensorBoard event files in
        ``tensorboard/`` (every regime logs through here, so all get it)."""
        if self._tensorboard is None:
            from torch.utils.tensorboard import SummaryWriter

            self._tensorboard = SummaryWriter(str(self.path / TENSORBOARD_DIR))

    def close(self) -> None:
        if self._tensorboard is not None:
            self._tensorboard.close()
            self._tensorboard = None

    def read_metrics(self) -> list[dict]:
        return read_metrics(self.metrics_path)

    def truncate_metrics(self, last_step: int) -> None:
        """On resume, drop records of steps after the checkpoint (they are redone)."""
        self.keep_metrics(lambda r: r.get("step", 0) <= last_step)

    def keep_metrics(self, keep_record: Callable[[dict], bool]) -> None:
        """Rewrite metrics.jsonl with the records ``keep_record`` keeps (atomic)."""
        if not self.metrics_path.is_file():
            return
        keep = [r for r in self.read_metrics() if keep_record(r)]
        tmp = self.metrics_path.with_suffix(".tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in keep))
        os.replace(tmp, self.metrics_path)

    def plot(self, title: str | None = None) -> Path | None:
        return plot_loss(self.metrics_path, self.path / PLOT, title or self.path.name)


def run_config(
    kind: str,
    model,
    *,
    tokenizer: dict,
    seq_len: int,
    train=None,
    data: Sequence[str | Path] = (),
    **extra,
) -> dict:
    """A run folder's ``config.json``, for every command that writes one:
    ``kind`` (what ``aisyn eval`` and ``--resume`` read it as), the model
    config, the training config, the data folders (resolved), the tokenizer
    (sha256, vocab_size, eod_id, pad_id) and sequence length, and what the
    command adds (``extra``)."""
    config: dict = {"kind": kind, "model": model.to_dict()}
    if train is not None:
        config["train"] = train.to_dict()
    if data:
        config["data"] = [str(Path(d).resolve()) for d in data]
    return {**config, "tokenizer": tokenizer, "seq_len": seq_len, **extra}


def read_metrics(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line cut short by a kill; the rest is still valid
    return out


def write_json_atomic(path: Path, obj) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, ensure_ascii=False))
    os.replace(tmp, path)


def plot_loss(
    metrics_path: Path,
    out_png: Path,
    title: str,
    key: str = "loss",
    x: str = "step",
) -> Path | None:
    """Loss (and validation loss, if logged) against step, as a PNG."""
    records = [r for r in read_metrics(metrics_path) if key in r and x in r]
    if not records:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4), dpi=100)
    ax.plot([r[x] for r in records], [r[key] for r in records], label=f"train {key}")
    val = [r for r in read_metrics(metrics_path) if "val_loss" in r]
    if val:
        ax.plot(
            [r[x] for r in val], [r["val_loss"] for r in val], "o-", label="valid loss"
        )
    ax.set_xlabel(x)
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    save_figure(fig, out_png)
    return out_png


def save_figure(fig, png: Path) -> None:
    """Lay out, write atomically (a reader never sees half a PNG) and close."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    tmp = png.with_name(png.stem + ".tmp.png")
    fig.savefig(tmp)
    plt.close(fig)
    os.replace(tmp, png)


def markdown_table(header: list[str], rows: list[list[str]]) -> list[str]:
    """The lines of a Markdown table of ``rows`` (their cells) under ``header``."""
    return [
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
        *("| " + " | ".join(cells) + " |" for cells in rows),
    ]


def write_csv(path: Path, rows: list[dict]) -> None:
    """``rows`` as CSV, a column per key of the first."""
    with path.open("w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
