"""Split (pipeline) training of PanGu-α across a data party and a compute party.

The data party A keeps the embedding and the head (tokens, labels and the loss
never leave it); the compute party B runs the middle blocks. See docs/split.md.

Modules: ``protocol`` (hello/reply and per-round control), ``schedule``
(lockstep and 1F1B orders), ``party`` (one party's weights, optimizer, global
clipping, checkpoints), ``data_party`` / ``compute_party`` (each side's
rounds), ``session`` (``SplitOptions`` and ``open_session``: in-process or gRPC
sessions, spawning a compute party), ``train`` (A's training loop), ``server``
(``aisyn split serve``), ``evaluate`` (evaluation through the link), ``merge``,
``transport``, ``cli``.
The cut itself lives in ``aisyn.model.segments``, the planner in
``aisyn.model.plan``.
"""
