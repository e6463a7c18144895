"""``aisyn generate``: a run's model continues a prompt, streamed as text.

Loads a run folder's latest checkpoint and the tokenizer it was trained with,
encodes the prompt the way training data were made, and decodes the new tokens
(``aisyn.model.generate``) into text as they come. Used by the command and by
``aisyn demo``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from aisyn.data.detokenizer import IncrementalDetokenizer
from aisyn.data.tokenizer import (
    Tokenizer,
    check_text,
    load_tokenizer,
    open_tokenizer,
)
from aisyn.model.causal_lm import CausalLM
from aisyn.model.generate import (
    Decoder,
    Sampling,
    StepDecoder,
    check_request,
    decode,
)
from aisyn.train.device import resolve_device
from aisyn.train.models import load_run_model
from aisyn.train.run import TOKENIZER, RunDir

log = logging.getLogger(__name__)


@dataclass
class Generator:
    """A run's model and tokenizer, ready to continue prompts."""

    model: CausalLM
    tokenizer: Tokenizer
    #: positions restart after each EOD in training (``--eod-reset``)
    eod_reset: bool = False
    #: the sample length the run was trained on (None: unknown)
    trained_len: int | None = None
    #: the decoder of one sequence of up to N positions: by default the
    #: model's with a KV cache; a split run's runs the middle through the link
    new_decoder: Callable[[int], StepDecoder] | None = None
    #: a pretrained folder's model: prompts get the tokenizer's own special
    #: tokens (Llama's BOS), as transformers gives them
    pretrained: bool = False

    def prompt_ids(self, prompt: str) -> list[int]:
        check_text(prompt, "--prompt")
        if self.pretrained:
            ids = self.tokenizer.tk.encode(prompt, add_special_tokens=True).ids
            if not ids:
                raise ValueError("--prompt is empty: it needs at least one token")
            return ids
        return prompt_ids(self.tokenizer, prompt, self.eod_reset)

    def complete(
        self,
        prompt: str,
        max_new_tokens: int,
        *,
        sampling: Sampling | None = None,
        write: Callable[[str], None] | None = None,
    ) -> str:
        """The text continuing ``prompt`` (stopping at ``<eod>``); each complete
        piece of it goes to ``write`` as soon as it is decoded."""
        sampling = sampling or Sampling()
        ids = self.prompt_ids(prompt)
        total = len(ids) + max_new_tokens
        if self.trained_len and total > self.trained_len:
            log.warning(
                "prompt + new tokens (%d) run past the %d positions the run was "
                "trained on; later positions are untrained",
                total,
                self.trained_len,
            )
        detok = IncrementalDetokenizer(self.tokenizer)
        pieces: list[str] = []

        def emit(text: str) -> None:
            if text:
                pieces.append(text)
                if write is not None:
                    write(text)

        ids = check_request(self.model.config, ids, max_new_tokens)
        new_decoder = self.new_decoder or (lambda n: Decoder(self.model, n))
        self.model.eval()  # no dropout while generating
        decoder = new_decoder(len(ids) + max_new_tokens)
        try:
            with torch.inference_mode():
                decode(
                    decoder,
                    ids,
                    max_new_tokens,
                    sampling,
                    eod_id=self.tokenizer.eod_id,
                    on_token=lambda t: emit(detok.push(t)),
                )
        finally:
            decoder.close()
        emit(detok.flush())
        return "".join(pieces)


def load_generator(run: str | Path, device: str = "auto") -> Generator:
    """The model of ``run``'s latest checkpoint and the run's tokenizer."""
    run_dir = RunDir(run)
    kind = run_dir.read_config().get("kind")
    if kind in ("split", "split-compute"):
        half = "data" if kind == "split" else "compute"
        raise ValueError(
            f"{run_dir.path}: holds only the {half} party's half of a split run; "
            "generate through the link with `aisyn split generate --run A_RUN` "
            "(from the data party's folder), or merge both halves first (aisyn "
            "split merge --data-party A_RUN --compute-party B_RUN --out MERGED) "
            "and generate from MERGED"
        )
    model, config = load_run_model(run_dir.path, resolve_device(device))
    return Generator(
        model,
        run_tokenizer(run_dir, config),
        eod_reset=bool(config.get("train", {}).get("eod_reset")),
        trained_len=config.get("seq_len"),
    )


def load_pretrained_generator(folder: str | Path, device: str = "auto") -> Generator:
    """A Hugging Face model folder (``hf:DIR``) with its own ``tokenizer.json``."""
    from aisyn.model.families import build_model
    from aisyn.model.hf import read_hf_folder
    from aisyn.train.checkpoint import load_weights

    tokenizer = load_tokenizer(f"hf:{folder}")
    cfg, state = read_hf_folder(folder)
    if tokenizer.vocab_size > cfg.vocab_size:
        raise ValueError(
            f"{folder}: tokenizer.json has {tokenizer.vocab_size} tokens, the "
            f"model embeds {cfg.vocab_size}: not this model's tokenizer"
        )
    model = build_model(cfg, device="meta")
    load_weights(model, state, str(folder))
    return Generator(
        model.to(resolve_device(device)).eval(), tokenizer, pretrained=True
    )


def run_tokenizer(run_dir: RunDir, config: dict) -> Tokenizer:
    """The tokenizer a run was trained with (its folder's copy, checked)."""
    tok_path = run_dir.path / TOKENIZER
    info = config.get("tokenizer", {})
    tokenizer = open_tokenizer(tok_path, info)
    if tokenizer.sha256 != info.get("sha256"):
        raise ValueError(f"{tok_path}: is not the tokenizer this run was trained with")
    return tokenizer


def prompt_ids(tokenizer: Tokenizer, prompt: str, eod_reset: bool) -> list[int]:
    """The prompt's token ids as the model saw documents in training.

    Without EOD reset a document follows the previous one's ``<eod>``, so the
    prompt is given one to start a document; with it, a document starts at
    position 0 and attends to nothing before it, so it gets none.
    """
    ids = tokenizer.encode(check_text(prompt, "--prompt"))
    if not eod_reset:
        ids = [tokenizer.eod_id, *ids]
    if not ids:
        raise ValueError(
            "--prompt is empty; this run (trained with --eod-reset) needs "
            "at least one token to continue"
        )
    return ids
