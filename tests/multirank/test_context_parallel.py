"""Context parallelism (SDPA attention, no Transformer Engine): CP=2 and CP=2×TP=2 equal CP=1.

One 4-rank spawn runs the same tiny HF Llama (GQA, perturbed weights; test_roles' model
and batch: left-padded prompts, right-padded responses of different lengths) in three
layouts: TP1·CP1·DP4 (the reference), TP1·CP2·DP2 and TP2·CP2·DP1. In each:

  (a) actor `forward_only` log-probs and entropies, padded rows and packed (THD) rows,
      equal CP=1's and transformers' within 1e-4 (test_roles' bound: fp32, different
      summation order only; observed ~1e-6);
  (b) critic values, padded and packed, equal CP=1's within 1e-4;
  (c) one actor step (PPO loss − 0.01·entropy, token-mean over the global mini-batch,
      grad clipping on) and one packed actor step give the same loss (1e-5 absolute, as
      in test_roles) and grad norm (1e-4 relative: the norm of the gradient after the
      DDP reduction over dp×cp, before clipping; a CP loss-scale or gather-backward bug
      changes it by a factor of 2), and the same weights after the step (each tensor's
      update within 1e-4 of its largest update, compared in the TP1 layout through
      dist_checkpointing);
  (d) one critic step gives the same loss and grad norm;
  (e) after the step, the exact KL to the (unchanged) reference, `kl_full` from
      `forward_only(kl_to=reference)`, equals CP=1's (1e-4 relative to its largest).
"""

from __future__ import annotations

import pytest
import torch

from rl_megatron.parallel import MEGATRON_RANK_ORDER, ParallelLayout
from tests.multirank.test_roles import (
    TOL,
    _assert_same_update,
    _make_checkpoint,
    _optim,
    _params,
    _ppo_loss,
    _sharded,
    _value_loss,
)
from tests.spawn import require_ranks, run_on_ranks

LAYOUTS = [(1, 1), (1, 2), (2, 2)]  # (tp, cp); dp = 4 / (tp·cp)
ENTROPY_COEF = 0.01


def _actor_loss(outputs, mbatch, totals):
    from rl_megatron.algorithms.aggregation import aggregate

    loss, metrics = _ppo_loss(outputs, mbatch, totals)
    ent = aggregate(outputs["entropy"], mbatch["response_mask"], "token-mean", totals=totals)
    metrics["entropy"] = ent.detach()
    return loss - ENTROPY_COEF * ent, metrics


def _rows(batch):
    """This replica's rows (the dp group is without CP: the CP ranks share rows)."""
    from megatron.core import parallel_state as ps

    size, rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    n = batch["prompts"].shape[0] // size
    return {k: v[rank * n : (rank + 1) * n] for k, v in batch.items()}


def _role(root, kind, tp, **kw):
    from rl_megatron.checkpoint import hf_builders as hb
    from rl_megatron.config import OptimConfig
    from rl_megatron.trainer.roles import MegatronRole

    hf = root / "llama"
    if kind == "actor":
        chunks = hb.build_actor(hf, ParallelLayout.from_megatron(), dtype=torch.float32)
        return MegatronRole(chunks, optim=_optim(), temperature=0.7, micro_batch_size=2, **kw)
    if kind == "reference":
        chunks = hb.build_reference(hf, ParallelLayout.from_megatron(), dtype=torch.float32)
        return MegatronRole(chunks, temperature=0.7, micro_batch_size=2, **kw)
    chunks = hb.build_critic(hf, ParallelLayout.from_megatron(), dtype=torch.float32, head_seed=1)
    optim = OptimConfig(lr=1e-2, weight_decay=0.0)
    return MegatronRole(chunks, optim=optim, micro_batch_size=2, **kw)


def _close(what, got, ref, mask, tol=TOL):
    err = (got - ref).abs()[mask.bool()].max().item()
    assert err < tol, f"{what}: max abs error {err:.2e} >= {tol}"


def _run_layout(root, batch, tp) -> dict:
    """Every output and metric of one layout; the stepped actors saved under root."""
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps

    cp = ps.get_context_parallel_world_size()
    name = f"tp{tp}cp{cp}"
    out = {}
    # TP2·CP2 takes the log-probs from the hidden states, 3 tokens at a time (the others
    # from the whole logits): the chunked path under CP against the reference's.
    chunk = 3 if tp > 1 else 0
    actor = _role(root, "actor", tp, logprob_chunk_tokens=chunk)
    assert actor.cp_size == cp
    fo = actor.forward_only(batch, with_entropy=True)
    out["log_prob"], out["entropy"] = fo["log_prob"], fo["entropy"]
    packed = _role(root, "actor", tp, pack_sequences=True, logprob_chunk_tokens=chunk)
    fo = packed.forward_only(batch, with_entropy=True)
    out["packed log_prob"], out["packed entropy"] = fo["log_prob"], fo["entropy"]
    critic = _role(root, "critic", tp)
    out["values"] = critic.forward_only(batch)["values"]
    out["packed values"] = _role(root, "critic", tp, pack_sequences=True).forward_only(batch)[
        "values"
    ]

    rows = _rows(batch)
    for role, key in ((actor, "step"), (packed, "packed step")):
        metrics = role.train_step(rows, _actor_loss, with_entropy=True)
        out[f"{key} loss"], out[f"{key} grad_norm"] = metrics["loss"], metrics["grad_norm"]
        assert metrics["grad_norm"] > 0.5, "grad clipping should be active in this test"
        path = root / f"{key.replace(' ', '_')}_{name}"
        path.mkdir(exist_ok=True)
        dist_checkpointing.save(_sharded(role), str(path))
    critic_rows = dict(rows, old_values=_rows(dict(batch, v=out["values"]))["v"])
    metrics = critic.train_step(critic_rows, _value_loss)
    out["critic loss"], out["critic grad_norm"] = metrics["loss"], metrics["grad_norm"]

    reference = _role(root, "reference", tp)
    out["kl_full"] = actor.forward_only(batch, kl_to=reference)["kl_full"]
    return out


def _body(rank: int, world_size: int, root) -> None:
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    batch = torch.load(root / "batch.pt")
    batch.pop("ref_grad_norm")
    mask = batch["response_mask"]
    results = {}
    for tp, cp in LAYOUTS:
        ps.destroy_model_parallel()
        ps.initialize_model_parallel(tp, 1, context_parallel_size=cp, order="tp-cp-ep-pp-dp")
        model_parallel_cuda_manual_seed(0)
        results[(tp, cp)] = _run_layout(root, batch, tp)

    ref = results[(1, 1)]
    for what in ("log_prob", "entropy"):
        _close(f"CP1 {what} vs transformers", ref[what], batch[f"ref_{what}"], mask)
    assert ref["kl_full"][mask.bool()].abs().max() > 1e-4, "the step should move the policy"
    for layout in LAYOUTS[1:]:
        got, name = results[layout], "tp{}cp{}".format(*layout)
        for what in ("log_prob", "entropy", "values", "packed values"):
            _close(f"{name} {what}", got[what], ref[what], mask)
        for what in ("packed log_prob", "packed entropy"):
            _close(f"{name} {what}", got[what], ref[what.split()[1]], mask)
        kl_scale = ref["kl_full"][mask.bool()].abs().max()
        _close(f"{name} kl_full", got["kl_full"], ref["kl_full"], mask, TOL * kl_scale)
        for what in ("step", "packed step", "critic"):
            loss, norm = got[f"{what} loss"], got[f"{what} grad_norm"]
            ref_loss, ref_norm = ref[f"{what} loss"], ref[f"{what} grad_norm"]
            assert abs(loss - ref_loss) < 1e-5, f"{name} {what}: loss {loss} vs {ref_loss}"
            assert abs(norm / ref_norm - 1) < TOL, f"{name} {what}: grad norm {norm} vs {ref_norm}"

    # Every layout's stepped weights, compared in the TP1·CP1 layout.
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(1, 1, order=MEGATRON_RANK_ORDER)
    model_parallel_cuda_manual_seed(0)
    actor = _role(root, "actor", 1)
    init = _params(actor)

    def load(key, tp, cp):
        path = root / f"{key}_tp{tp}cp{cp}"
        loaded = dist_checkpointing.load(_sharded(actor), str(path))
        return {f"0.{k}": v.clone() for k, v in loaded["chunk0"].items()}

    for key in ("step", "packed_step"):
        base = load(key, 1, 1)
        for tp, cp in LAYOUTS[1:]:
            _assert_same_update(f"{key} tp{tp}cp{cp} vs CP1", init, base, load(key, tp, cp))


@pytest.mark.slow
def test_context_parallel_matches_cp1(tmp_path):
    require_ranks(4)
    _make_checkpoint(tmp_path)
    run_on_ranks(_body, world_size=4, root=tmp_path)
