"""Split (pipeline) training of PanGu-α across a data party and a compute party.

The data party A keeps the embedding and the head (tokens, labels and the loss
never leave it); the compute party B runs the middle blocks. See docs/split.md.

By party:

* ``client/`` -- the data party A: its session and rounds (``data_party``),
  its ranks (``data_ranks``), the split executor, and what it runs:
  ``train``, ``evaluate``, ``generate``, ``merge``;
* ``backbone/`` -- the compute party B: ``compute_party`` (sessions),
  ``rounds``, ``pipeline`` (over ranks), ``shards`` (checkpoint shares);
* ``centre/`` -- B serving many owners: ``server`` (``aisyn split serve``),
  ``tenants``, ``tenant_batch``, ``fair_share``, ``tenant_metrics``,
  ``metrics_endpoint``, ``consortium`` (SplitFed's shared backbone);
* ``defence/`` -- what protects the cut, all at A: ``cut_dp``,
  ``bottleneck``, ``calibration``, ``warmup``, ``emulator``, ``attach``.

Both parties share ``protocol`` (hello/reply and per-round control),
``schedule`` (lockstep and 1F1B orders), ``party`` (one party's weights,
optimizer, clipping, checkpoints), ``session`` (``SplitOptions``,
``open_session``), ``transport``, ``sharding`` and ``cli``. The cut itself
lives in ``aisyn.model.segments``, the planner in ``aisyn.split.planner``.
"""
