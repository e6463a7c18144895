"""Generation with a KV cache: the cache reproduces full recomputation, the
sampler is seeded and filters as documented, and ``aisyn generate`` streams the
completion alone to stdout."""

import json
import math

import pytest
import torch

from aisyn.model.families import build_model
from aisyn.model.generate import (
    Decoder,
    Sampling,
    generate,
    top_k_filter,
    top_p_filter,
)
from aisyn.model.pangu import PanguConfig


@pytest.fixture(scope="module")
def model():
    cfg = PanguConfig(
        vocab_size=96, hidden_size=32, num_layers=3, num_heads=4, ffn_size=64,
        seq_len=40,
    )  # fmt: skip
    return build_model(cfg, seed=3).eval()


PROMPT = [5, 17, 2, 60, 33, 8]


def test_cached_steps_match_full_recomputation(model):
    cached, full = Decoder(model, 40), Decoder(model, 40, use_cache=False)
    with torch.no_grad():
        a, b = cached.start(PROMPT), full.start(PROMPT)
        for _ in range(30):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
            token = int(torch.argmax(b))
            a, b = cached.step(token), full.step(token)
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    assert cached.cache.length == len(PROMPT) + 30


def test_greedy_generation_is_argmax_of_the_full_forward(model):
    out = generate(model, PROMPT, 30)

    seq = list(PROMPT)
    with torch.no_grad():
        for _ in range(30):
            seq.append(int(model(torch.tensor([seq]))[0, -1].argmax()))
    assert out == seq[len(PROMPT) :]
    assert generate(model, PROMPT, 30, use_cache=False) == out


def test_several_new_positions_after_cached_ones_stay_causal(model):
    tokens = torch.randint(0, 96, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = model(tokens)
        cache = model.new_cache(20, batch_size=2)
        parts = [model(tokens[:, a:b], cache=cache) for a, b in [(0, 7), (7, 12)]]
        parts += [model(tokens[:, i : i + 1], cache=cache) for i in range(12, 20)]
    torch.testing.assert_close(torch.cat(parts, 1), full, rtol=0, atol=1e-5)


def test_the_training_path_takes_no_cache_work(model):
    # Without a cache forward() is the plain path: no masks, no cache objects.
    tokens = torch.tensor([PROMPT])
    with torch.no_grad():
        assert torch.equal(model(tokens), model(tokens, cache=None))


def test_same_seed_same_tokens_other_seed_other_tokens(model):
    def run(seed):
        return generate(model, PROMPT, 25, temperature=1.0, seed=seed)

    assert run(1) == run(1)
    assert run(1) != run(2)  # 25 draws from ~uniform over 96: equal by chance ~0


def test_top_k_one_is_greedy(model):
    greedy = generate(model, PROMPT, 20)
    assert generate(model, PROMPT, 20, temperature=2.0, top_k=1, seed=9) == greedy


def test_top_p_keeps_the_smallest_set_reaching_p():
    probs = torch.tensor([0.05, 0.5, 0.15, 0.3])
    logits = probs.log()

    def kept(p):
        return set((top_p_filter(logits, p) > -math.inf).nonzero().flatten().tolist())

    assert kept(0.5) == {1}  # the top token alone reaches 0.5
    assert kept(0.51) == {1, 3}
    assert kept(0.8) == {1, 3}  # 0.5 + 0.3 reaches 0.8 exactly
    assert kept(0.81) == {1, 3, 2}
    assert kept(0.01) == {1}  # the most likely token always stays
    assert kept(1.0) == {0, 1, 2, 3}
    # Rows are filtered independently.
    rows = top_p_filter(torch.stack([logits, logits.flip(0)]), 0.6)
    assert (rows > -math.inf).sum(1).tolist() == [2, 2]


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(temperature=1e-45),  # logits / T overflowed to +-inf: NaN softmax
        dict(temperature=1e-300),  # T rounds to 0 in float32: 0/0 is NaN
        dict(temperature=1e-300, top_k=3, top_p=0.5),
        dict(temperature=1.0, top_p=1e-300),  # p rounds to 0 in float32
        dict(temperature=1e-45, top_p=1e-300, top_k=3),
    ],
)
def test_extreme_valid_sampling_values_pick_the_top_token(model, kwargs):
    """Values that pass validation sample (not crash with "probability tensor
    contains inf/nan"): both limits leave only the most likely token."""
    greedy = generate(model, PROMPT, 12)
    assert generate(model, PROMPT, 12, seed=4, **kwargs) == greedy


def test_non_finite_logits_are_refused_not_sampled():
    from aisyn.model.generate import next_token

    logits = torch.zeros(10)
    logits[3] = float("nan")
    for sampling in (Sampling(), Sampling(temperature=1.0)):
        with pytest.raises(FloatingPointError, match="logits are not finite"):
            next_token(logits, sampling, torch.Generator().manual_seed(0))


def test_top_k_keeps_exactly_k_even_with_ties():
    logits = torch.tensor([1.0, 3.0, 3.0, 3.0, 0.0])
    kept = top_k_filter(logits, 2) > -math.inf
    assert kept.sum() == 2 and not kept[0] and not kept[4]
    assert torch.equal(top_k_filter(logits, 0), logits)


def test_stops_at_eod_without_returning_it(model):
    greedy = generate(model, PROMPT, 12)
    # An EOD id the greedy run produces at step 3 (and not before).
    step = next(i for i in range(3, 12) if greedy[i] not in greedy[:i])
    streamed = []

    out = generate(model, PROMPT, 12, eod_id=greedy[step], on_token=streamed.append)

    assert out == greedy[:step] == streamed


def test_prompt_plus_new_tokens_over_seq_len_is_refused(model):
    assert len(generate(model, PROMPT, 40 - len(PROMPT))) == 40 - len(PROMPT)
    with pytest.raises(ValueError, match="exceeds the model's seq_len 40; use at"):
        generate(model, PROMPT, 41 - len(PROMPT))
    with pytest.raises(ValueError, match="shorten the prompt"):
        generate(model, [1] * 40, 1)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(temperature=-0.1), "temperature must be"),
        (dict(temperature=float("nan")), "temperature must be"),
        (dict(top_k=-1), "top-k must be"),
        (dict(top_p=0.0), r"top-p must be in \(0, 1\]"),
        (dict(top_p=1.5), r"top-p must be in \(0, 1\]"),
    ],
)
def test_bad_sampling_settings_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Sampling(**kwargs)


def test_bad_lengths_and_prompts_are_refused(model):
    with pytest.raises(ValueError, match="max-new-tokens must be >= 1"):
        generate(model, PROMPT, 0)
    with pytest.raises(ValueError, match="prompt is empty"):
        generate(model, [], 5)
    with pytest.raises(ValueError, match=r"must be in 0\.\.95"):
        generate(model, [96], 5)


def test_cache_capacity_is_bounded_by_seq_len(model):
    with pytest.raises(ValueError, match="capacity must be in 1..40"):
        model.new_cache(41)
    cache = model.new_cache(4)
    with torch.no_grad():
        model(torch.tensor([[1, 2, 3]]), cache=cache)
        with pytest.raises(ValueError, match="exceed the KV cache's 4"):
            model(torch.tensor([[1, 2]]), cache=cache)


def test_generation_leaves_the_model_mode_alone(model):
    model.train()
    try:
        generate(model, PROMPT, 3)
        assert model.training
    finally:
        model.eval()


# --- aisyn generate -----------------------------------------------------------


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory, news_data, tiny_config):
    from aisyn.train.config import TrainConfig
    from aisyn.train.pretrain import train

    run = tmp_path_factory.mktemp("gen") / "run"
    cfg = TrainConfig(steps=3, batch_size=4, lr=3e-3, warmup_steps=1, log_every=1)
    train(tiny_config, [news_data], run, cfg, progress=False)
    return run


def test_cli_streams_the_completion_alone_to_stdout(trained_run, capsys):
    from aisyn.cli import main
    from aisyn.eval.generate import load_generator

    argv = ["generate", "--run", str(trained_run), "--prompt", "本报北京讯"]
    assert main([*argv, "--max-new-tokens", "8", "--device", "cpu"]) == 0
    out = capsys.readouterr().out

    expected = load_generator(trained_run, "cpu").complete("本报北京讯", 8)
    assert out == expected + "\n"

    # Sampling: the seed goes to stderr when not given, and repeats the run.
    sample = [*argv, "--max-new-tokens", "8", "--temperature", "1", "--top-p", "0.9"]
    assert main([*sample, "--seed", "5"]) == 0
    first = capsys.readouterr()
    assert main([*sample, "--seed", "5"]) == 0
    assert capsys.readouterr().out == first.out
    assert main(sample) == 0
    assert "--seed" in capsys.readouterr().err


def test_cli_refuses_a_split_run_with_one_line(tmp_path, capsys):
    from aisyn.cli import main

    (tmp_path / "config.json").write_text(json.dumps({"kind": "split"}))
    code = main(["generate", "--run", str(tmp_path), "--prompt", "x"])
    err = capsys.readouterr().err
    assert code == 2
    assert err.count("\n") == 1 and "aisyn split merge" in err


def test_cli_refuses_too_many_new_tokens_with_one_line(trained_run, capsys):
    from aisyn.cli import main

    argv = ["generate", "--run", str(trained_run), "--prompt", "本报"]
    assert main([*argv, "--max-new-tokens", "500", "--device", "cpu"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "exceeds the model's seq_len 32" in captured.err
    assert captured.err.count("\n") == 1


@pytest.mark.parametrize(
    "flag, value",
    [
        ("--max-new-tokens", "0"),
        ("--temperature", "-1"),
        ("--temperature", "nan"),
        ("--top-k", "-1"),
        ("--top-p", "0"),
        ("--top-p", "1.01"),
        ("--seed", "-3"),
    ],
)
def test_cli_bad_flags_fail_while_parsing(flag, value, capsys):
    from aisyn.cli import build_parser

    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(
            ["generate", "--run", "nowhere", "--prompt", "x", flag, value]
        )
    assert e.value.code == 2
    assert flag in capsys.readouterr().err


def test_cli_refuses_a_prompt_with_undecodable_bytes(trained_run, capsys):
    """A shell passes bytes that are not UTF-8 as lone surrogates; SentencePiece
    rejected them with a pybind11 cast error naming nothing."""
    from aisyn.cli import main

    argv = ["generate", "--run", str(trained_run), "--prompt", "本报\udcff北京"]
    assert main([*argv, "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "--prompt is not valid UTF-8 text (byte 0xff at character 2)" in err
