"""The planner: where to cut a model between the data party and the compute
party, from their throughput and their devices' memory (``aisyn split plan``).

``model.cost`` and ``model.memory`` hold the arithmetic (FLOPs, bytes, each
rank's peak); this package weighs the cuts with it (``search``), says what it
chose (``plan``: ``PartySpec``, ``Plan``) and, when no cut fits, what would
(``fit``).
"""

from aisyn.split.planner.plan import PartySpec, Plan, rank_groups
from aisyn.split.planner.search import (
    MIN_A_BLOCKS,
    candidates,
    evaluate,
    exposure_warning,
    plan,
)

__all__ = [
    "MIN_A_BLOCKS",
    "PartySpec",
    "Plan",
    "candidates",
    "evaluate",
    "exposure_warning",
    "plan",
    "rank_groups",
]
