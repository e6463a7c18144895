"""``aisyn eval``: LM loss / perplexity on a test split and cloze accuracy."""

from __future__ import annotations

import logging
import math
from pathlib import Path

from aisyn.data.cloze import build_items, read_items
from aisyn.data.corpora import BUILTIN_CORPORA, load_corpora
from aisyn.data.shards import TokenShards, read_manifest
from aisyn.eval.cloze import cloze_accuracy
from aisyn.eval.generate import run_tokenizer
from aisyn.train.device import resolve_device
from aisyn.train.models import load_run_model
from aisyn.train.objective import evaluate_loss
from aisyn.train.run import RunDir, write_json_atomic

log = logging.getLogger(__name__)


def corpus_specs(manifest: dict) -> list[str]:
    """The corpora a data folder was prepared from (built-in names or paths)."""
    specs = manifest.get("corpus_specs")
    if specs:
        return specs
    name = manifest.get("corpus", "")
    return [n for n in name.split("+") if n in BUILTIN_CORPORA]


def evaluate_run(
    run: str | Path,
    *,
    data_dir: str | Path | None = None,
    cloze_file: str | Path | None = None,
    per_document: int = 3,
    max_items: int | None = None,
    cloze_format: str | None = None,
    device: str = "auto",
    batch_size: int = 16,
    model=None,
) -> dict:
    """``model``: evaluate this model (e.g. a split run's ``SplitModel``) instead
    of loading the run's checkpoint."""
    dev = resolve_device(device)
    run_dir = RunDir(run)
    if model is None and run_dir.read_config().get("kind") == "split":
        # A split run holds only the data party's half: it is evaluated through
        # the link, which the split package (a layer above this one) opens.
        raise ValueError(
            f"{run_dir.path}: a split run; evaluate it through the link with "
            "aisyn.split.client.evaluate.evaluate_split_run (`aisyn eval` does)"
        )
    if model is None:
        model, config = load_run_model(run_dir.path, dev)
    else:
        config = run_dir.read_config()
    tok = run_tokenizer(run_dir, config)
    # Fine-tuned runs (standalone, or split with --sft) learnt the prompt format.
    fine_tuned = config.get("kind") == "finetune" or config.get("objective") == "sft"
    fmt = cloze_format or ("prompt" if fine_tuned else "lm")
    result: dict = {"run": str(run_dir.path)}
    if data_dir is not None:
        test = TokenShards.open(data_dir, "test", tokenizer_sha256=tok.sha256)
        eod = tok.eod_id if config.get("train", {}).get("eod_reset") else None
        loss = evaluate_loss(model, test, batch_size=batch_size, eod_id=eod, device=dev)
        result["test"] = {
            "data": str(data_dir),
            "loss": loss,
            "perplexity": math.exp(min(loss, 50.0)),
            "samples": len(test),
        }
        log.info(
            "test loss %.4f  perplexity %.2f  (%d samples)",
            loss,
            result["test"]["perplexity"],
            len(test),
        )
    items, source = None, None
    if cloze_file is not None:
        items, source = read_items(cloze_file), str(cloze_file)
    elif data_dir is not None:
        specs = corpus_specs(read_manifest(data_dir))
        if specs:
            items = build_items(load_corpora(specs), "test", per_document=per_document)
            source = f"{'+'.join(specs)} test split, {per_document} per document"
    if items:
        items = items[:max_items] if max_items else items
        acc = cloze_accuracy(
            model, items, tok, fmt=fmt, batch_size=batch_size, device=dev
        )
        result["cloze"] = {"source": source, **acc}
        log.info(
            "cloze accuracy %.2f%% (95%% CI %.2f-%.2f%%, %d items, chance %.1f%%)",
            100 * acc["accuracy"],
            100 * acc["ci95"][0],
            100 * acc["ci95"][1],
            acc["items"],
            100 * acc["chance"],
        )
    write_json_atomic(run_dir.path / "eval.json", result)
    return result


def summary_lines(result: dict) -> list[str]:
    """What ``aisyn eval`` and ``aisyn split eval`` print of an ``evaluate_run``
    result: a test-loss line and a cloze line, for those it holds."""
    lines = []
    if "test" in result:
        t = result["test"]
        lines.append(
            f"test loss {t['loss']:.4f}  perplexity {t['perplexity']:.2f}  "
            f"({t['samples']} samples)"
        )
    if "cloze" in result:
        c = result["cloze"]
        lines.append(
            f"cloze accuracy {100 * c['accuracy']:.2f}% on {c['items']} items "
            f"(95% CI {100 * c['ci95'][0]:.2f}-{100 * c['ci95'][1]:.2f}%, "
            f"chance {100 * c['chance']:.1f}%)"
        )
    return lines


__all__ = ["evaluate_run", "summary_lines"]
