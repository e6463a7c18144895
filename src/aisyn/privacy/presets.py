"""``aisyn privacy audit --preset ci|full``: the whole measurement in one
command, on the comparison's own data: news is A's private text, reviews
the public text the base is pretrained on and B fits its decoders on.

It writes, to ``--out``:

* ``frontier.md``, ``frontier.csv``, ``frontier.json``, ``frontier.png``:
  the yardstick (``yardstick.py``) of every configuration of the preset --
  what it keeps of fine-tuning's gain and what B's attacks still recover --
  rewritten after each one, with the configuration that meets the goal (or
  the best trade); ``runs/``: each configuration's split run, merged model
  and scores (``--resume`` reuses them);
* ``cuts/``: the undefended audit of every cut (``audit.audit``), early (the
  base's weights) and late (A's weights after the undefended run).

``ci`` runs every piece in minutes (its numbers mean nothing); ``full`` is
the measurement quoted in docs/privacy.md (hours on a 2-core CPU).
"""

from __future__ import annotations

import logging
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from aisyn.data.sft import SFTData
from aisyn.data.tokenizer import PanguTokenizer
from aisyn.eval.cloze import encode_items
from aisyn.model.families import preset_fields
from aisyn.privacy.audit import AuditSettings, audit, draw_rows
from aisyn.privacy.inverters import InverterSettings
from aisyn.privacy.yardstick import (
    UNDEFENDED,
    Config,
    Inputs,
    best_trade,
    is_default,
    measure,
    score,
    summarise,
    write,
)
from aisyn.split.defence.calibration import calibrate
from aisyn.split.defence.cut_dp import RECOMMENDED
from aisyn.testbed.inputs import cached_base, cached_sft, cached_shards
from aisyn.testbed.presets import get_preset
from aisyn.train.config import TrainConfig
from aisyn.train.models import load_run_model
from aisyn.validate import MAX_SEED

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class AuditPreset:
    experiments: str  # the comparison preset whose data (and sizes) are used
    samples: int  # rows of A's test text attacked
    public_samples: int  # public rows B fits decoders on (and clips calibrate on)
    attack_steps: int  # optimisation steps of each white-box attack
    train_steps: int  # steps of each split fine-tuning run
    batch_size: int
    lr: float
    warmup: int
    eval_batches: int  # test batches scored per run
    cuts: tuple[str, ...]  # the undefended audit's cuts
    cut: str  # where every configuration's run cuts
    configs: tuple[Config, ...]
    seeds: tuple[int, ...]  # of the default's, the undefended and the candidate's
    #: the configuration proposed as the default, run over every seed too
    candidate: str | None = None
    model: str | None = None  # a model size instead of the comparison's
    pretrain_steps: int | None = None  # of the public-only base
    seq_len: int | None = None  # instead of the comparison's
    cloze_items: int | None = None  # A's cloze test items scored (None: all)
    # B's sequence inverter and the known-plaintext bound (A's own pairs come
    # from the train split of A's text, never the rows attacked)
    inverter: InverterSettings = field(default_factory=InverterSettings)


#: The trained bottleneck measured (not tuned): a floor of 16 lets at most
#: H/2 · log(1 + 1/16²) ≈ 0.5 nats per token cross at hidden size 256 (a
#: token of 8 000 needs 9), and a capacity term weighing a tenth of a nat
#: per nat: enough to move σ against the loss's pull, not to swamp it.
BOTTLENECK_FLOOR = 16.0
BOTTLENECK_BETA = 0.1


def _noise(name: str, forward: float, backward: float, **kw) -> Config:
    return Config(name, forward=forward, backward=backward, **kw)


def _bottleneck(name: str, **kw) -> Config:
    return Config(
        name, bottleneck_floor=BOTTLENECK_FLOOR, bottleneck_beta=BOTTLENECK_BETA, **kw
    )


AUDIT_PRESETS = {
    "ci": AuditPreset(
        experiments="ci",
        samples=2,
        public_samples=16,
        attack_steps=5,
        train_steps=4,
        batch_size=4,
        lr=1e-3,
        warmup=1,
        eval_batches=2,
        # the ci model has two ordinary blocks: cuts keep B one of them
        cuts=("u:0,0", "u:1,0"),
        cut="u:1,0",
        configs=(
            UNDEFENDED,
            _noise("noise", RECOMMENDED.forward, RECOMMENDED.backward),
            Config("frozen backbone", backbone="frozen"),
            Config("frozen + warm-up", backbone="frozen", private_warmup=3),
            _bottleneck("bottleneck", backward=RECOMMENDED.backward),
        ),
        seeds=(0, 1),
        candidate="frozen + warm-up",
        cloze_items=16,
        # tiny: every piece runs, in a second or two per fit
        inverter=InverterSettings(
            width=32,
            layers=1,
            heads=2,
            steps=20,
            lr=3e-3,
            batch=4,
            known_pairs=8,
            known_steps=10,
        ),
    ),
    "full": AuditPreset(
        experiments="full",
        samples=8,
        public_samples=256,
        attack_steps=100,
        train_steps=1000,
        batch_size=8,
        lr=3e-4,
        warmup=30,
        eval_batches=20,
        # u:1,1 with B knowing the base is in the table ("undefended"); the
        # cut audit adds no block on A, and B knowing nothing
        cuts=("u:0,0", "u:1,1"),
        cut="u:1,1",
        # the reference and the default first (the table is written after
        # each configuration), then the combinations, then each mechanism alone
        configs=(
            UNDEFENDED,
            _noise("noise (recommended σ)", RECOMMENDED.forward, RECOMMENDED.backward),
            _bottleneck("bottleneck + gradient noise", backward=RECOMMENDED.backward),
            _bottleneck(
                "frozen + warm-up + bottleneck", backbone="frozen", private_warmup=200
            ),
            _noise(
                "frozen + warm-up + forward noise",
                0.1,
                0.0,
                backbone="frozen",
                private_warmup=200,
            ),
            Config("frozen + warm-up", backbone="frozen", private_warmup=200),
            Config("frozen backbone", backbone="frozen"),
            Config(
                "frozen backbone, front frozen", backbone="frozen", front_via="frozen"
            ),
            Config("warm-up", private_warmup=200),
        ),
        seeds=(0, 1),
        model="small",
        seq_len=64,
        pretrain_steps=1000,
        cloze_items=256,
        # Two layers on ~3 500 public rows: a transformer of that kind read
        # 93 % of the inputs undefended at u:1,0 on the ci base (the shared
        # privacy facts). A step of 16 rows of 128 tokens at width 128, with a
        # head over all 8 000 tokens, took 1.2 s on the shared 2-core box:
        # each run's attacks add up to about 10 minutes.
        inverter=InverterSettings(
            width=128,
            layers=2,
            heads=4,
            steps=400,
            lr=1e-3,
            batch=16,
            known_pairs=256,
            known_steps=100,
            public_rows=3500,
        ),
    ),
}


def run_preset(
    name: str, out: str | Path, *, seed: int = 0, resume: bool = False
) -> dict:
    """The yardstick (``privacy.yardstick``) of every configuration of the
    preset, on a base pretrained on public text only, then the undefended
    audit of every cut on that base."""
    if name not in AUDIT_PRESETS:
        raise ValueError(
            f"unknown preset {name!r}; expected one of {list(AUDIT_PRESETS)}"
        )
    p = AUDIT_PRESETS[name]
    out = Path(out)
    if out.exists() and any(out.iterdir()) and not resume:
        raise FileExistsError(
            f"{out}: exists and is not empty; choose another --out (or --resume)"
        )
    if resume and (out / "cuts").exists():
        shutil.rmtree(out / "cuts")  # the cut audit runs again at the end
    t0 = time.perf_counter()
    experiments = get_preset(p.experiments).with_overrides(
        model=preset_fields(p.model) if p.model else None,
        pretrain_steps=p.pretrain_steps,
        seq_len=p.seq_len,
    )
    tok = PanguTokenizer.load()
    news = cached_shards("news", tok, experiments)
    reviews = cached_shards("reviews", tok, experiments)
    # The base never sees A's domain: what fine-tuning gains is then real.
    base = cached_base(experiments, [reviews], tok, "cpu")
    # the rows every configuration's attacks read, and the cut audit's
    settings = AuditSettings(
        samples=p.samples,
        public_samples=p.public_samples,
        steps=p.attack_steps,
        seed=seed,
        inverter=p.inverter,
    )
    drawn = draw_rows(news, reviews, tok.sha256, settings)
    cfg = TrainConfig(
        steps=p.train_steps,
        batch_size=p.batch_size,
        lr=p.lr,
        warmup_steps=p.warmup,
        log_every=max(1, p.train_steps // 20),
        device="cpu",
    )
    base_model, _ = load_run_model(base)
    base_model.eval().requires_grad_(False)
    news_sft = cached_sft("news", tok, experiments)
    items = SFTData.open(news_sft, "train").test_items()
    inputs = Inputs(
        mcfg=base_model.config,
        base=base,
        data=news,
        sft=news_sft,
        cloze=encode_items(
            items[: p.cloze_items], tok, base_model.config.seq_len, "prompt"
        ),
        pad_id=tok.pad_id,
        cut=p.cut,
        eval_batches=p.eval_batches,
        attack_steps=p.attack_steps,
        inverter=p.inverter,
        **vars(drawn),
    )
    clips = calibrate(base_model, drawn.public_rows, p.cut, p.batch_size)
    base_scores = score(base_model, inputs, p.batch_size)
    # another stream than the data's; --seed MAX_SEED too
    seeds = [(seed + 1 + s) % (MAX_SEED + 1) for s in p.seeds]
    results: dict[str, list[dict]] = {}
    report = {
        "preset": name,
        "settings": asdict(p),
        "train": cfg.to_dict(),
        "base": base_scores,
        "base_model": str(base),
        "seeds": seeds,
        "runs": results,
    }
    # every seed of the undefended run and the default first (the summary
    # line's: a long preset's first tables already hold it), then the
    # candidate's, then every other configuration over the first seed
    first = [
        (n, c) for n, c in enumerate(p.configs) if c == UNDEFENDED or is_default(c)
    ]
    candidate = [(n, c) for n, c in enumerate(p.configs) if c.name == p.candidate]
    order = [(n, c, s) for n, c in first for s in seeds]
    order += [(n, c, s) for n, c in candidate for s in seeds]
    order += [
        (n, c, seeds[0])
        for n, c in enumerate(p.configs)
        if (n, c) not in first and (n, c) not in candidate
    ]
    for n, c, s in order:
        log.info("configuration %d/%d: %s, seed %d", n + 1, len(p.configs), c.name, s)
        r = measure(c, s, inputs, clips, cfg, out / "runs" / c.folder(s))
        results.setdefault(c.name, []).append({"seed": s, **r})
        log.info("%s", {k: v for k, v in r.items() if k != "attacks"})
        # the table so far: a long preset's first rows are readable at once
        rows_out = summarise(results, list(p.configs), base_scores)
        report.update(
            rows=rows_out,
            choice=best_trade(rows_out),
            default=next((r for r in rows_out if r["default"]), None),
            frontier_elapsed_s=time.perf_counter() - t0,
        )
        write(out, report)
    # The undefended audit of every cut, late = A's weights after the
    # undefended run of the first seed.
    cuts = audit(
        base,
        news,
        reviews,
        out / "cuts",
        list(p.cuts),
        trained=out / "runs" / UNDEFENDED.folder(seeds[0]) / "merged",
        settings=settings,
    )
    report["cuts_elapsed_s"] = cuts["elapsed_s"]
    report["elapsed_s"] = time.perf_counter() - t0
    write(out, report)
    return report
