"""Text generation: greedy or sampled decoding with a KV cache.

``generate`` extends a prompt of token ids one token at a time. With the KV
cache (the default) the prompt runs once and each new token costs one position;
``use_cache=False`` recomputes the whole sequence every step, the oracle the
tests and ``bench/generate_speed.py`` compare against. Sampling draws from a
``torch.Generator`` seeded by ``seed`` on the CPU, so the same seed gives the
same tokens on any device the logits come from.

The model layer knows no tokenizer: streaming hands token ids to ``on_token``
(``aisyn.data.detokenizer.IncrementalDetokenizer`` turns them into text).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from aisyn.model.causal_lm import CausalLM, KVCache
from aisyn.model.families import ModelConfig


@dataclass(frozen=True)
class Sampling:
    """How the next token is picked from the logits.

    ``temperature`` 0 is greedy (argmax; ``top_k``/``top_p`` then change
    nothing), as is any below float32's smallest normal number (``greedy``).
    Otherwise logits are divided by the temperature, cut to the ``top_k``
    most likely tokens (0: no cut), then to the smallest set whose
    probability reaches ``top_p`` (1: no cut), and sampled.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        # Each check names the flag that sets it: these values come from users.
        t = self.temperature
        if not isinstance(t, int | float) or not math.isfinite(t) or t < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {t!r}")
        k = self.top_k
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise ValueError(f"top-k must be an integer >= 0 (0: off), got {k!r}")
        p = self.top_p
        if not isinstance(p, int | float) or not 0 < p <= 1:
            raise ValueError(f"top-p must be in (0, 1] (1: off), got {p!r}")

    @property
    def greedy(self) -> bool:
        # Logits are divided by T in float32, where a T below its smallest
        # normal number (1e-300 rounds to 0) gives 0/0 = NaN for the top
        # logit: such a T leaves only the top token anyway, so pick it.
        return self.temperature < torch.finfo(torch.float32).tiny


def top_k_filter(logits: torch.Tensor, k: int) -> torch.Tensor:
    """``logits`` (..., V) with all but the ``k`` largest per row set to -inf.

    Exactly ``k`` survive even when logits tie (kept by index, as ``topk``
    breaks ties); ``k`` 0 or >= V keeps everything.
    """
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    top = torch.topk(logits, k, dim=-1)
    out = torch.full_like(logits, -math.inf)
    return out.scatter(-1, top.indices, top.values)


def top_p_filter(logits: torch.Tensor, p: float) -> torch.Tensor:
    """``logits`` (..., V) cut to the nucleus: the smallest set of most likely
    tokens whose probability reaches ``p``, the rest set to -inf.

    A token stays if the probability of the tokens ranked above it is still
    below ``p``, so the most likely token always stays and the set stops at
    the first token that reaches ``p``.
    """
    if p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    probs = torch.softmax(sorted_logits.float(), dim=-1)
    mass_before = torch.cumsum(probs, dim=-1) - probs
    drop_sorted = mass_before >= p
    # The most likely token stays whatever p is: a p below float32's range
    # (1e-300) compares as 0 with the first token's mass_before, 0, and would
    # drop every token.
    drop_sorted[..., 0] = False
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, -math.inf)


def next_token(
    logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None
) -> int:
    """The next token for one row of logits (V,)."""
    if not bool(torch.isfinite(logits).all()):
        # NaN logits sample garbage (or make multinomial raise): say what is
        # wrong instead of printing what it picked.
        raise FloatingPointError(
            "the model's logits are not finite (NaN or inf): its weights or "
            "its inputs are broken"
        )
    if sampling.greedy:
        return int(torch.argmax(logits))
    # Shifted so the largest is 0 before dividing: a tiny temperature (1e-45)
    # then sends the others to -inf, not every logit to +-inf (NaN softmax).
    logits = logits.float()
    scaled = (logits - logits.max()) / sampling.temperature
    scaled = top_p_filter(top_k_filter(scaled, sampling.top_k), sampling.top_p)
    # Sampled on the CPU: one generator, the same draws whatever the device.
    probs = torch.softmax(scaled, dim=-1).cpu()
    return int(torch.multinomial(probs, 1, generator=generator))


class Decoder:
    """The logits of the next token, one step at a time, for one sequence.

    ``start(prompt)`` returns the logits after the prompt, ``step(token)`` those
    after appending ``token``. With ``use_cache`` each step runs one position
    through a ``KVCache``; without, the whole sequence is recomputed (the
    reference the cache must reproduce).
    """

    def __init__(self, model: CausalLM, capacity: int, use_cache: bool = True):
        self.model = model
        self.capacity = capacity
        self.use_cache = use_cache
        self.device = next(model.parameters()).device
        self.cache: KVCache | None = None
        self.tokens: list[int] = []

    def start(self, prompt: Sequence[int]) -> torch.Tensor:
        self.tokens = list(prompt)
        if self.use_cache:
            self.cache = self.model.new_cache(self.capacity)
        return self._run(self.tokens)

    def step(self, token: int) -> torch.Tensor:
        self.tokens.append(token)
        return self._run([token] if self.use_cache else self.tokens)

    def close(self) -> None:
        self.cache = None  # the keys and values are not needed any more

    def _run(self, ids: list[int]) -> torch.Tensor:
        x = torch.tensor([ids], dtype=torch.long, device=self.device)
        # Only the last position's logits are needed: project just that row.
        h = self.model.hidden(x, cache=self.cache)[0, -1]
        return self.model.logits(h)


class StepDecoder(Protocol):
    """What ``decode`` drives: logits of the next token after the prompt
    (``start``), then after each appended token (``step``). ``Decoder`` runs a
    whole model; a split run's data party runs its half and the link
    (``aisyn.split.client.generate.SplitDecoder``)."""

    def start(self, prompt: Sequence[int]) -> torch.Tensor: ...

    def step(self, token: int) -> torch.Tensor: ...

    def close(self) -> None:
        """Free the sequence's cache (on every party that holds part of it)."""


def check_request(
    cfg: ModelConfig, prompt_ids: Sequence[int], max_new_tokens: int
) -> list[int]:
    """The prompt as a list of ints, after checking it and ``max_new_tokens``
    against the model (``cfg``); one line naming what to change otherwise."""
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int):
        raise ValueError(f"max-new-tokens must be an integer, got {max_new_tokens!r}")
    if max_new_tokens < 1:
        raise ValueError(f"max-new-tokens must be >= 1, got {max_new_tokens}")
    prompt = [int(t) for t in prompt_ids]
    if not prompt:
        raise ValueError("the prompt is empty: generation needs at least one token")
    seq_len = cfg.seq_len
    # Positions beyond seq_len have no learned position (or query) embedding.
    needed = len(prompt) + max_new_tokens
    if needed > seq_len:
        room = seq_len - len(prompt)
        hint = (
            f"use at most {room} new tokens or a shorter prompt"
            if room > 0
            else "shorten the prompt"
        )
        raise ValueError(
            f"prompt of {len(prompt)} tokens + {max_new_tokens} new tokens exceeds "
            f"the model's seq_len {seq_len}; {hint}"
        )
    vocab = cfg.vocab_size
    if min(prompt) < 0 or max(prompt) >= vocab:
        raise ValueError(f"prompt token ids must be in 0..{vocab - 1}")
    return prompt


def decode(
    decoder: StepDecoder,
    prompt: Sequence[int],
    max_new_tokens: int,
    sampling: Sampling,
    *,
    eod_id: int | None = None,
    on_token: Callable[[int], None] | None = None,
) -> list[int]:
    """The sampling loop of ``generate`` over any ``StepDecoder``: the same
    filters and the same seeded CPU generator, so that two decoders giving the
    same logits give the same tokens. Arguments checked by the caller
    (``check_request``)."""
    generator = None
    if not sampling.greedy:
        generator = torch.Generator(device="cpu")
        generator.manual_seed(sampling.seed)
    logits = decoder.start(prompt)
    out: list[int] = []
    while True:
        token = next_token(logits, sampling, generator)
        if token == eod_id:
            break
        out.append(token)
        if on_token is not None:
            on_token(token)
        if len(out) == max_new_tokens:
            break
        logits = decoder.step(token)
    return out


@torch.inference_mode()
def generate(
    model: CausalLM,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int = 0,
    eod_id: int | None = None,
    on_token: Callable[[int], None] | None = None,
    use_cache: bool = True,
) -> list[int]:
    """Up to ``max_new_tokens`` token ids continuing ``prompt_ids``.

    Stops early after ``eod_id`` (not returned, not passed to ``on_token``).
    ``on_token(id)`` is called for each new token as soon as it is chosen, for
    streaming. See ``Sampling`` for ``temperature``, ``top_k``, ``top_p``;
    ``seed`` seeds the sampler, so equal seeds give equal tokens.
    """
    sampling = Sampling(temperature, top_k, top_p, seed)
    prompt = check_request(model.config, prompt_ids, max_new_tokens)
    was_training = model.training
    model.eval()  # no dropout while generating
    try:
        decoder = Decoder(model, len(prompt) + max_new_tokens, use_cache=use_cache)
        return decode(
            decoder,
            prompt,
            max_new_tokens,
            sampling,
            eod_id=eod_id,
            on_token=on_token,
        )
    finally:
        model.train(was_training)
