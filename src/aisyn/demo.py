"""``aisyn demo``: the embedded default job, end to end on a 2-core CPU.

Prepares a slice of the news corpus (People's Daily, Jan 1998) with the shipped
tokenizer, trains the tiny PanGu-α, evaluates test loss and cloze accuracy on
the news test split, leaves a loss plot, and lets the model continue a news
prompt (greedy, ``DEMO_NEW_TOKENS`` tokens).

The demo can be resumed: it records its settings in ``DEMO_FILE`` first and
checkpoints its training every ``CKPT_EVERY`` steps, so re-running it on the
same ``--out`` after an interruption keeps the prepared data, goes on from the
last checkpoint (bit-identical to an uninterrupted run) and prints what an
uninterrupted run prints; a finished demo re-run prints its results again
without training or evaluating anything.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

from aisyn.data.corpora import load_corpus
from aisyn.data.folder import MANIFEST
from aisyn.data.shards import prepare
from aisyn.data.tokenizer import PanguTokenizer
from aisyn.eval.generate import load_generator
from aisyn.eval.report import evaluate_run
from aisyn.train.config import TrainConfig
from aisyn.train.pretrain import train
from aisyn.train.run import write_json_atomic
from aisyn.validate import read_json

log = logging.getLogger(__name__)

# A People's Daily dateline (the corpus writes digits full-width), so the model
# continues the kind of text it was trained on.
DEMO_PROMPT = "本报北京１月２日讯"
DEMO_NEW_TOKENS = 30
#: The demo's settings (written first) and, once it has finished, its result.
DEMO_FILE = "demo.json"
#: Training checkpoints this often: an interrupted demo loses at most this
#: many steps (about 30 s of the 1 000 on the 2-core box).
CKPT_EVERY = 100


def _flags(settings: dict) -> str:
    return (
        f"--steps {settings['steps']} --max-docs {settings['max_docs']} "
        f"--model {settings['model']}"
    )


def _earlier(out: Path, settings: dict, overwrite: bool) -> dict | None:
    """What ``out`` holds of an earlier demo of these ``settings`` (its
    ``DEMO_FILE``), None for a fresh start; refuses a folder that holds
    anything else unless ``overwrite`` (which empties it)."""
    if not out.exists() or not any(out.iterdir()):
        return None
    if overwrite:
        shutil.rmtree(out)
        return None
    file = out / DEMO_FILE
    earlier = read_json(file) if file.is_file() else None
    if not isinstance(earlier, dict) or not isinstance(earlier.get("settings"), dict):
        raise FileExistsError(
            f"{out}: holds something else than a demo; pass --overwrite or "
            "another --out"
        )
    if earlier["settings"] != settings:
        raise FileExistsError(
            f"{out}: holds a demo of {_flags(earlier['settings'])}; give those "
            "to resume it, or pass --overwrite or another --out"
        )
    return earlier


def run_demo(
    out: str | Path, *, steps: int, max_docs: int, model: str, overwrite: bool
) -> dict:
    """The demo in ``out`` (its defaults are ``aisyn demo``'s flags), resumed
    where an earlier run of the same settings stopped."""
    out = Path(out)
    settings = {"steps": steps, "max_docs": max_docs, "model": model}
    earlier = _earlier(out, settings, overwrite)
    if earlier is not None and "result" in earlier:
        log.info(
            "%s: this demo has finished; its results (--overwrite runs it again)",
            out,
        )
        return earlier["result"]
    out.mkdir(parents=True, exist_ok=True)
    write_json_atomic(out / DEMO_FILE, {"settings": settings})
    data, run = out / "data", out / "run"
    if (data / MANIFEST).is_file():  # prepare swaps a folder in only when whole
        log.info("[1/3] the news documents are prepared already in %s", data)
    else:
        log.info("[1/3] preparing %d news documents -> %s", max_docs, data)
        prepare(
            load_corpus("news"),
            PanguTokenizer.load(),
            128,
            data,
            max_documents=max_docs,
            corpus_specs=["news"],
            overwrite=True,  # what an interrupted prepare left
        )
    log.info("[2/3] training the %s model for %d steps -> %s", model, steps, run)
    cfg = TrainConfig(
        steps=steps,
        batch_size=16,
        lr=3e-3,
        min_lr=3e-4,
        warmup_steps=50,
        log_every=25,
        eval_every=250,
        ckpt_every=CKPT_EVERY,
    )
    # an interrupted demo's run goes on from its last checkpoint (none: step 0)
    summary = train(model, [data], run, cfg, resume=(run / "config.json").is_file())
    log.info("[3/3] evaluating on the news test split")
    result = evaluate_run(run, data_dir=data, per_document=1)
    completion = load_generator(run, "cpu").complete(DEMO_PROMPT, DEMO_NEW_TOKENS)
    done = {
        "eval": result,
        "plot": summary["plot"],
        "completion": {"prompt": DEMO_PROMPT, "text": completion},
    }
    write_json_atomic(out / DEMO_FILE, {"settings": settings, "result": done})
    return {"train": summary, **done}
