"""Cross-centre training a wide-area link can carry: DiLoCo.

Data-parallel training all-reduces every step's gradients, and across
centres joined by a wide-area link that all-reduce is the whole cost (a 2.6B
model's fp32 gradients are 10.4 GB a step). DiLoCo (Douillard et al., 2023)
synchronises rarely: each centre takes ``inner_steps`` (H) steps of its own
optimizer on its own data, then the centres average their *pseudo-gradients*
(the global model minus their local one), an outer optimizer -- SGD with
Nesterov momentum, OpenDiLoCo's lr 0.7 and momentum 0.9 -- steps the global
model, and every centre goes on from it. One exchange every H steps instead
of H, optionally in bf16 / fp16, or int8 with a scale per block of the flat
delta (INTELLECT-1's choice): 2x or 4x fewer bytes again.

The exchange is ``torch.distributed`` (gloo on CPU, NCCL on GPU) on the
centres' process group: an all-reduce of fp32 deltas, or an all-gather of the
compressed ones that every centre decodes and averages in the same order, so
all centres compute the same global model to the bit. torchft's DiLoCo was
considered and not used (docs/cross_centre.md says why).

``DiLoCoExecutor`` wraps a centre's local executor from outside: the model
and the local executor know nothing of it. An outer step whose averaged delta
is not finite is skipped on every centre (each returns to the last global
model), and ``max_skipped`` such steps in a row stop the run with one line. A
centre whose own delta is out of bound (``train.diloco.guard``: its norm
against the others' and its own history, its direction against the run's) is
left out of the mean by name, and ``max_skipped`` such steps in a row stop
the run naming it.
"""

from __future__ import annotations

from aisyn.train.diloco.centre import (  # noqa: F401
    admit,
    agreed_checkpoint,
    centre_executor,
    centre_folder,
    centre_settings,
    check_resume,
    check_same_run,
    fingerprints,
    joining_centres,
)
from aisyn.train.diloco.config import (  # noqa: F401
    DATA_MODES,
    INT8_BLOCK,
    OUTER_FILE,
    PRECISIONS,
    DiLoCoConfig,
    OuterStepError,
)
from aisyn.train.diloco.executor import (  # noqa: F401
    DiLoCoExecutor,
    fragments_of,
)
from aisyn.train.diloco.outer import (  # noqa: F401
    Exchange,
    OuterSync,
)
from aisyn.train.diloco.topology import (  # noqa: F401
    Topology,
    centre_label,
    centre_of,
    label_logs,
    topology,
)
from aisyn.train.diloco.wire import (  # noqa: F401
    decode,
    encode,
    encoded_bytes,
    payload_bytes,
    ring_bytes_sent,
)
