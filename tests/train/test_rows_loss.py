"""``RowsLoss``: a micro-batch's loss as a sum over its rows, so that ranks
sharing the rows sum to it; and the plain data rank 0 hands the other ranks,
refused in one line when it is not a loss."""

from __future__ import annotations

import pytest
import torch

from aisyn.train.objective import RowsLoss, lm_step_batch, sft_step_batch


def head(hidden: torch.Tensor) -> torch.Tensor:
    return hidden @ torch.linspace(-1, 1, 4 * 9).view(4, 9)


def test_row_shares_sum_to_the_micro_batch_loss_of_both_objectives():
    torch.manual_seed(0)
    hidden = torch.randn(4, 5, 4)
    batch = torch.randint(0, 9, (8, 6))
    answers = torch.where(torch.rand(8, 5) < 0.5, -100, batch[:, 1:6])
    steps = (lm_step_batch(batch, 4, None), sft_step_batch(batch[:, :5], answers, 4))
    for step in steps:
        targets = step.micro[0][1]
        whole = step.loss_of(head, hidden, targets)
        shares = sum(
            step.rows_loss(head, hidden[r], targets[r])
            for r in (slice(0, 1), slice(1, 3), slice(3, 4))
        )
        assert torch.allclose(shares, whole, rtol=1e-6), (shares, whole)
        assert RowsLoss.from_dict(step.rows_loss.to_dict()) == step.rows_loss


@pytest.mark.parametrize(
    "bad",
    [
        {"divisor": float("nan"), "kind": "lm"},
        {"divisor": float("inf"), "kind": "lm"},
        {"divisor": 0, "kind": "lm"},
        {"divisor": -3.0, "kind": "sft"},
        {"divisor": "12", "kind": "lm"},
        {"divisor": 12.0, "kind": "mse"},
        {"kind": "lm"},
    ],
)
def test_a_rows_loss_that_is_not_one_is_refused(bad):
    with pytest.raises(ValueError, match="bad rows loss .*finite divisor > 0"):
        RowsLoss.from_dict(bad)
