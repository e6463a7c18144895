"""Generating text from a split run through the link: tokens never leave A.

``aisyn split generate --run A_RUN`` comes here: the data party loads its half
at its latest checkpoint, opens a ``generate`` session with the compute party
(reached as ``aisyn split eval`` reaches it), and decodes with a
``SplitDecoder``: the same sampling loop, filters and seeded generator as
``aisyn generate`` (``model.generate.decode``), so a split run and its merged
model give the same tokens. Each party keeps the KV cache of its own layers;
per step only the new positions' hidden states cross, each way.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from aisyn.eval.generate import Generator, prompt_ids, run_tokenizer
from aisyn.model.families import config_from_dict
from aisyn.model.generate import Sampling, check_request
from aisyn.split.client.evaluate import open_data_session, split_run_config
from aisyn.split.transport import LinkSettings
from aisyn.train.run import RunDir


def split_generate(
    run: str | Path,
    prompt: str,
    max_new_tokens: int,
    *,
    sampling: Sampling | None = None,
    device: str | torch.device = "cpu",
    peer: LinkSettings | None = None,
    mode: str | None = None,
    write: Callable[[str], None] | None = None,
) -> str:
    """The text continuing ``prompt`` with the split run ``run`` (see
    ``Generator.complete``); ``peer``/``mode`` choose the compute party as for
    ``open_data_session``."""
    run_dir = RunDir(run)
    # Checked before anything loads or connects.
    config = split_run_config(
        run_dir,
        "`aisyn split generate` takes the folder `aisyn split train --out` wrote "
        "(`aisyn generate` an ordinary run)",
    )
    tokenizer = run_tokenizer(run_dir, config)
    # Refused here, before the compute party is reached, as aisyn generate would
    eod_reset = bool(config["train"].get("eod_reset"))
    check_request(
        config_from_dict(config["model"]),
        prompt_ids(tokenizer, prompt, eod_reset),
        max_new_tokens,
    )
    with open_data_session(
        run_dir.path, device, purpose="generate", peer=peer, mode=mode
    ) as (session, config):
        gen = Generator(
            session.state.model,
            tokenizer,
            eod_reset=eod_reset,
            trained_len=config.get("seq_len"),
            new_decoder=session.decoder,
        )
        return gen.complete(prompt, max_new_tokens, sampling=sampling, write=write)
