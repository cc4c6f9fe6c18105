"""A non-finite loss or gradient norm never reaches the weights, nor the engine
(`trainer.on_nonfinite`).

Two DP ranks train GRPO with the replayed rollout of `tests/trainer_probe.py`; from the
second step on, rank 1's actor loss is made non-finite. `stop`: the step ends on every rank
with one `NonFiniteUpdateError` naming the step, the role and the rank, with the actor's
weights those of the last finite step and the engine never given newer ones. That holds for
each non-finite value, not only NaN: an infinite loss whose gradients are finite (only the
loss check sees it), and a finite loss whose gradient holds one infinite element (only the
gradient-norm check sees it: the norm is inf, not NaN). `skip`: that step leaves the weights
as they were and is counted; the run trains on.
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.spawn import run_on_ranks
from tests.trainer_probe import build_probe_trainer, probe_config


def _actor_weights(trainer) -> list[torch.Tensor]:
    return [p.detach().clone() for chunk in trainer.roles.actor.model for p in chunk.parameters()]


class _InfiniteGradient(torch.autograd.Function):
    """Identity forward; backward gives every element an infinite gradient (not NaN)."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return torch.full_like(grad, float("inf"))


def _poison(trainer, rank: int, from_step: int) -> dict:
    """Rank `rank`'s actor loss is made non-finite from training step index `from_step` on;
    how is the returned dict's `fault`: `nan` (loss times NaN), `inf` (loss plus inf: the
    gradients stay finite) or `inf_grad` (a finite loss, one weight's gradient +inf)."""
    original = trainer._actor_loss
    state = {"fault": "nan"}
    weight = next(trainer.roles.actor.model[0].parameters())

    def loss(out, mb, totals):
        value, metrics = original(out, mb, totals)
        if trainer.step >= from_step and torch.distributed.get_rank() == rank:
            if state["fault"] == "nan":
                value = value * float("nan")
            elif state["fault"] == "inf":
                value = value + float("inf")
            else:  # adds 0 to the loss, and +inf to one element of the weight's gradient
                value = value + 0.0 * _InfiniteGradient.apply(weight.reshape(-1)[:1]).sum()
        return value, metrics

    trainer._actor_loss = loss
    return state


def _record_generations(trainer) -> list[int]:
    """The weight version the engine holds at each `generate`."""
    versions: list[int] = []
    original = trainer.engine.generate

    def generate(*args, **kwargs):
        versions.append(trainer.engine.weight_version)
        return original(*args, **kwargs)

    trainer.engine.generate = generate
    return versions


def _body(rank, world_size, tmp_path, mode):
    from rl_megatron.distributed import distributed_run
    from rl_megatron.trainer.optimizer_step import NonFiniteUpdateError

    config = probe_config(
        tmp_path,
        {},
        [
            "algorithm.adv_estimator=grpo",
            f"trainer.on_nonfinite={mode}",
            "trainer.total_steps=3",
            # The engine keeps the version it last got while asleep (level 2 drops it), so
            # the end of the run shows which weights it was given last.
            "rollout.sleep_level=1",
        ],
    )
    with distributed_run(seed=config.trainer.seed, timeout_s=120) as run:
        trainer = build_probe_trainer(config, run, total_steps=3)
        generated_with = _record_generations(trainer)
        poison = _poison(trainer, rank=1, from_step=1)
        if mode == "stop":
            trainer.train_step()  # step 1, finite
            trainer.step += 1
            finite = _actor_weights(trainer)
            # Step 2 again after each stop (cheaper than a run per fault): the weights the
            # engine got stay step 1's.
            for fault, what, norm_finite in (
                ("inf", "loss on rank 1", True),
                ("inf_grad", "gradient norm", False),
                ("nan", "loss on rank 1", None),
            ):
                poison["fault"] = fault
                with pytest.raises(NonFiniteUpdateError) as raised:
                    trainer.train_step()
                message = str(raised.value)
                assert message.startswith(
                    f"step 2: actor: non-finite {what} at its optimizer step 2 (grad norm "
                ), message
                assert "\n" not in message
                norm = float(message.split("(grad norm ")[1].split(")")[0])
                if norm_finite is not None:  # the fault is the one meant, and only it
                    assert math.isfinite(norm) is norm_finite and not math.isnan(norm), message
                assert all(torch.equal(a, b) for a, b in zip(finite, _actor_weights(trainer)))
            # The engine got the weights of steps 0 and 1 only: nothing after the faults.
            assert generated_with == [0, 1, 1, 1], generated_with
            assert trainer.engine.weight_version == 1
            return
        first = trainer.train_step()
        trainer.step += 1
        before = _actor_weights(trainer)
        skipped = trainer.train_step()
        trainer.step += 1
        assert first["actor/steps_skipped"] == 0 and skipped["actor/steps_skipped"] == 1
        assert skipped["actor/update_successful"] == 0
        assert all(torch.equal(a, b) for a, b in zip(before, _actor_weights(trainer)))
        trainer._actor_loss = type(trainer)._actor_loss.__get__(trainer)  # healthy again
        healthy = trainer.train_step()
        assert healthy["actor/steps_skipped"] == 0
        assert not all(torch.equal(a, b) for a, b in zip(before, _actor_weights(trainer)))


@pytest.mark.parametrize("mode", ["stop", "skip"])
def test_nonfinite_loss_or_grad_norm_on_one_rank(tmp_path, mode):
    run_on_ranks(_body, world_size=2, tmp_path=tmp_path, mode=mode)
