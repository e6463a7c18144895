"""``aisyn demo``: the embedded default job, end to end on a 2-core CPU.

Prepares a slice of the news corpus (People's Daily, Jan 1998) with the shipped
tokenizer, trains the tiny PanGu-α, evaluates test loss and cloze accuracy on
the news test split, leaves a loss plot, and lets the model continue a news
prompt (greedy, ``DEMO_NEW_TOKENS`` tokens).
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

from aisyn.data.corpora import load_corpus
from aisyn.data.shards import prepare
from aisyn.data.tokenizer import PanguTokenizer
from aisyn.eval.generate import load_generator
from aisyn.eval.report import evaluate_run
from aisyn.train.config import TrainConfig
from aisyn.train.pretrain import train

log = logging.getLogger(__name__)

# A People's Daily dateline (the corpus writes digits full-width), so the model
# continues the kind of text it was trained on.
DEMO_PROMPT = "本报北京１月２日讯"
DEMO_NEW_TOKENS = 30


def run_demo(
    out: str | Path, *, steps: int, max_docs: int, model: str, overwrite: bool
) -> dict:
    """The demo in ``out`` (its defaults are ``aisyn demo``'s flags')."""
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        if not overwrite:
            raise FileExistsError(
                f"{out}: holds an earlier demo; pass --overwrite or another --out"
            )
        shutil.rmtree(out)
    data, run = out / "data", out / "run"
    log.info("[1/3] preparing %d news documents -> %s", max_docs, data)
    prepare(
        load_corpus("news"),
        PanguTokenizer.load(),
        128,
        data,
        max_documents=max_docs,
        corpus_specs=["news"],
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
    )
    summary = train(model, [data], run, cfg)
    log.info("[3/3] evaluating on the news test split")
    result = evaluate_run(run, data_dir=data, per_document=1)
    completion = load_generator(run, "cpu").complete(DEMO_PROMPT, DEMO_NEW_TOKENS)
    return {
        "train": summary,
        "eval": result,
        "plot": summary["plot"],
        "completion": {"prompt": DEMO_PROMPT, "text": completion},
    }
