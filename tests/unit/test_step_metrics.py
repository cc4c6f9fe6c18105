"""A step's metrics: shares summed over micro-batches, read once for all steps."""

from __future__ import annotations

import pytest
import torch

from rl_megatron.trainer.step_metrics import reduce_step, resolve


def _micro(loss: float, frac: float) -> dict[str, torch.Tensor]:
    return {"loss": torch.tensor(loss), "actor/clipfrac": torch.tensor(frac)}


def test_every_metric_share_is_summed_per_step():
    cpu = torch.device("cpu")
    first = reduce_step([_micro(0.5, 0.1), _micro(0.25, 0.3)], None, cpu)
    second = reduce_step([{"critic/vf_loss": torch.tensor(2.0)}], None, cpu)
    second.host["lr"] = 1e-6
    out = resolve([first, second], is_pp_last=True, pp_group=None, pp_last_rank=0)
    # Shares: 0.1 and 0.3 of the mini-batch's tokens were clipped, 0.4 in all.
    assert out[0] == pytest.approx({"loss": 0.75, "actor/clipfrac": 0.4})
    assert out[1] == pytest.approx({"critic/vf_loss": 2.0, "lr": 1e-6})


def test_a_step_without_micro_batches_has_nothing_to_reduce():
    pending = reduce_step([], None, torch.device("cpu"))
    assert pending.keys == [] and pending.sums is None
