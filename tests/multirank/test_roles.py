"""`MegatronRole`: forward-only and train steps through megatron's schedules, and offload.

One 4-rank spawn walks three layouts of the same tiny HF Llama (GQA, perturbed weights,
built in the test): TP1·PP1·DP4, TP2·PP2·DP1, TP1·PP2·VPP2·DP2 (interleaved schedule).
The batch has left-padded prompts and right-padded responses of different lengths.

In every layout:
  (a) actor `forward_only` log-probs (temperature 0.7) and entropies equal a transformers
      fp32 forward on the same checkpoint, and the TP1·PP1 result, within 1e-4 (the
      parity bound of test_hf_parity; observed ~1e-6, summation order only);
  (b) one PPO step (policy loss, token-mean over the global mini-batch, grad clipping on)
      gives the same loss (1e-5 absolute: the loss, ~1e-2, is a mean of O(1) per-token
      terms that nearly cancel, each off by ~1e-6; a normalisation bug is off by O(loss))
      as TP1·PP1·DP4, and the grad norm of a transformers backward of the same loss on
      the whole mini-batch (1e-4 relative: clipping and Adam would hide a loss-scale bug
      from the weight comparison, not from the norm);
      the stepped weights are saved with dist_checkpointing and, at the end, compared in
      the TP1·PP1 layout: each tensor's update within 1e-4 of its largest update (Adam's
      first update lr·g/(|g|+eps) with eps = 1e-2 is a smooth, invertible function of g,
      so equal updates mean equal gradients; a layout bug shows as O(1) error).
At TP2·PP2 also:
  (c) the update (1e-4 of the largest update) and grad norm are the same with 1, 2, 4 fixed
      micro-batches and with token-budget dynamic micro-batches (3, of different shapes);
  (d) critic `forward_only` values equal TP1·PP1's within 1e-4 and three value-loss
      steps on one batch lower the loss;
  (e) offloading params, grads and optimizer state frees their storages, a reload
      restores them bit for bit, and the next step matches a never-offloaded twin exactly.
"""

from __future__ import annotations

import pytest
import torch

from rl_megatron.parallel import MEGATRON_RANK_ORDER, ParallelLayout
from tests.multirank.test_hf_parity import _perturb
from tests.spawn import run_on_ranks

V, B, P, R = 100, 8, 6, 5
TEMPERATURE = 0.7
TOL = 1e-4
LAYOUTS = [(1, 1, None), (2, 2, None), (1, 2, 2)]
PROMPT_LENS = [6, 3, 5, 2, 6, 4, 1, 5]
RESPONSE_LENS = [5, 2, 4, 5, 1, 3, 5, 2]


def _batch() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    prompts = torch.zeros(B, P, dtype=torch.long)
    responses = torch.zeros(B, R, dtype=torch.long)
    for i, (p, r) in enumerate(zip(PROMPT_LENS, RESPONSE_LENS)):
        prompts[i, P - p :] = torch.randint(1, V, (p,), generator=gen)
        responses[i, :r] = torch.randint(1, V, (r,), generator=gen)
    prompt_mask = prompts != 0
    response_mask = (responses != 0).long()
    attention_mask = torch.cat([prompt_mask.long(), response_mask], dim=1)
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    return {
        "prompts": prompts,
        "responses": responses,
        "attention_mask": attention_mask,
        "position_ids": position_ids,
        "response_mask": response_mask,
        "advantages": torch.randn(B, R, generator=gen),
        "returns": torch.randn(B, R, generator=gen),
    }


def _make_checkpoint(root) -> None:
    """A tiny Llama, and transformers' log-probs / entropies of the batch's responses."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=V,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    _perturb(model, 0)
    model.save_pretrained(root / "llama", safe_serialization=True)
    batch = _batch()
    ids = torch.cat([batch["prompts"], batch["responses"]], dim=1)
    with torch.no_grad():
        logits = model(
            ids, attention_mask=batch["attention_mask"], position_ids=batch["position_ids"]
        ).logits
    logp = torch.log_softmax(logits[:, P - 1 : P - 1 + R].double() / TEMPERATURE, dim=-1)
    mask = batch["response_mask"].bool()
    ref_lp = logp.gather(-1, batch["responses"].unsqueeze(-1)).squeeze(-1).float()
    ref_ent = -(logp.exp() * logp).sum(-1).float()
    batch["ref_log_prob"] = torch.where(mask, ref_lp, 0.0)
    batch["ref_entropy"] = torch.where(mask, ref_ent, 0.0)
    # The sampling policy differs a little from the current one, so some ratios clip.
    noise = 0.3 * torch.randn(B, R, generator=torch.Generator().manual_seed(5))
    batch["old_log_prob"] = torch.where(mask, ref_lp + noise, 0.0)
    # The reference gradient norm of one PPO loss on the whole mini-batch: a wrong loss
    # scale (DP size, micro-batch count) would be hidden from the weight comparison by
    # grad clipping and by Adam's near scale-invariance, but not from this.
    logits = model(
        ids, attention_mask=batch["attention_mask"], position_ids=batch["position_ids"]
    ).logits
    logp = torch.log_softmax(logits[:, P - 1 : P - 1 + R] / TEMPERATURE, dim=-1)
    lp = logp.gather(-1, batch["responses"].unsqueeze(-1)).squeeze(-1)
    outputs = {"log_prob": lp}
    loss, _ = _ppo_loss(outputs, batch, None)
    loss.backward()
    norm = torch.stack([p.grad.norm() for p in model.parameters() if p.grad is not None])
    batch["ref_grad_norm"] = norm.norm()
    torch.save(batch, root / "batch.pt")


def _optim():
    from rl_megatron.config import OptimConfig

    # clip_grad small enough to clip, so the global norm over TP/PP shards is tested too.
    return OptimConfig(lr=1e-2, adam_eps=1e-2, weight_decay=0.0, clip_grad=0.5)


def _ppo_loss(outputs, mbatch, totals):
    from rl_megatron.algorithms.losses import policy_loss

    return policy_loss(
        outputs["log_prob"],
        mbatch["old_log_prob"],
        mbatch["advantages"],
        mbatch["response_mask"],
        0.2,
        0.2,
        3.0,
        "token-mean",
        totals=totals,
    )


def _value_loss(outputs, mbatch, totals):
    from rl_megatron.algorithms.losses import value_loss

    return value_loss(
        outputs["values"],
        mbatch["old_values"],
        mbatch["returns"],
        mbatch["response_mask"],
        0.5,
        totals=totals,
    )


def _dp_rows(batch):
    from megatron.core import parallel_state as ps

    size, rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    n = B // size
    return {k: v[rank * n : (rank + 1) * n] for k, v in batch.items()}


def _actor(root, tp, pp, vpp, **kw):
    from rl_megatron.checkpoint.hf_builders import build_actor
    from rl_megatron.trainer.roles import MegatronRole

    chunks = build_actor(root / "llama", ParallelLayout.from_megatron(), dtype=torch.float32)
    kw.setdefault("micro_batch_size", 2)
    return MegatronRole(chunks, optim=_optim(), temperature=TEMPERATURE, **kw)


def _critic(root, tp, pp, **kw):
    from rl_megatron.checkpoint.hf_builders import build_critic
    from rl_megatron.config import OptimConfig
    from rl_megatron.trainer.roles import MegatronRole

    chunks = build_critic(
        root / "llama", ParallelLayout.from_megatron(), dtype=torch.float32, head_seed=1
    )
    return MegatronRole(
        chunks, optim=OptimConfig(lr=1e-2, weight_decay=0.0), micro_batch_size=2, **kw
    )


def _params(role) -> dict[str, torch.Tensor]:
    return {
        f"{i}.{n}": p.detach().clone()
        for i, chunk in enumerate(role.model)
        for n, p in chunk.module.named_parameters()
    }


def _sharded(role) -> dict:
    state = {}
    for i, chunk in enumerate(role.model):
        sd = chunk.module.sharded_state_dict()
        state[f"chunk{i}"] = {k: v for k, v in sd.items() if "_extra_state" not in k}
    return state


def _assert_same_update(what, init, a, b):
    moved = 0
    for key in init:
        da, db = a[key] - init[key], b[key] - init[key]
        scale = da.abs().max()
        if scale <= 1e-6:
            # At TP2 the last vocabulary shard holds padding rows only: no gradient there.
            assert db.abs().max() <= 1e-6, f"{what}: {key} moved in one run only"
            continue
        moved += 1
        err = ((da - db).abs().max() / scale).item()
        assert err < TOL, f"{what}: update of {key} differs by {err:.2e} of its largest"
    assert moved >= len(init) - 1, f"{what}: only {moved}/{len(init)} tensors were updated"


def _close(what, got, ref, mask):
    err = (got - ref).abs()[mask.bool()].max().item()
    assert err < TOL, f"{what}: max abs error {err:.2e} >= {TOL}"


def _check_micro_batching(root, batch, main_update, init, ref_norm):
    """(c) the same mini-batch in 1, 2, 4 fixed or 3 dynamic micro-batches: same update."""
    variants = {
        "1 micro-batch": dict(micro_batch_size=8),
        "2 micro-batches": dict(micro_batch_size=4),
        "dynamic": dict(use_dynamic_batch=True, max_tokens_per_micro_batch=24),
        # Padding-free: each micro-batch's rows packed into one THD sequence.
        "packed": dict(pack_sequences=True),
        "packed, dynamic": dict(
            pack_sequences=True, use_dynamic_batch=True, max_tokens_per_micro_batch=24
        ),
    }
    for name, kw in variants.items():
        role = _actor(root, 2, 2, None, **kw)
        if name == "dynamic":
            assert len(role._split(batch, None)) == 3
        if kw.get("pack_sequences"):
            out = role.forward_only(batch, with_entropy=True)
            mask = batch["response_mask"]
            _close(f"{name} log_prob vs transformers", out["log_prob"], batch["ref_log_prob"], mask)
            _close(f"{name} entropy vs transformers", out["entropy"], batch["ref_entropy"], mask)
        norm = role.train_step(batch, _ppo_loss)["grad_norm"]
        assert abs(norm / ref_norm - 1) < TOL, f"{name}: grad norm {norm} vs {ref_norm}"
        _assert_same_update(f"{name} vs 4 micro-batches", init, main_update, _params(role))


def _check_offload(root, batch):
    """(e) offload → reload is lossless and training continues exactly."""
    from rl_megatron.config import OffloadConfig

    twin = _actor(root, 2, 2, None)
    role = _actor(root, 2, 2, None, offload=OffloadConfig(params=True, grads=True, optimizer=True))
    for r in (twin, role):
        r.train_step(batch, _ppo_loss)
    before = _params(role)
    adam = [
        v.clone()
        for opt in getattr(role.optimizer, "chained_optimizers", [role.optimizer])
        for s in opt.optimizer.state.values()
        for v in s.values()
        if torch.is_tensor(v)
    ]
    assert adam, "no Adam state to offload"
    freed = role.offload()
    param = next(role.model[0].module.parameters())
    assert freed > 0 and param.untyped_storage().nbytes() == 0
    assert role.model[0].buffers[0].grad_data.untyped_storage().nbytes() == 0
    with pytest.raises(RuntimeError, match="offloaded"):
        role.forward_only(batch)
    role.reload()
    after = _params(role)
    assert all(torch.equal(before[k], after[k]) for k in before)
    adam_after = [
        v
        for opt in getattr(role.optimizer, "chained_optimizers", [role.optimizer])
        for s in opt.optimizer.state.values()
        for v in s.values()
        if torch.is_tensor(v)
    ]
    assert all(torch.equal(x, y) for x, y in zip(adam, adam_after))
    m_twin, m_role = twin.train_step(batch, _ppo_loss), role.train_step(batch, _ppo_loss)
    assert m_twin["loss"] == m_role["loss"] and m_twin["grad_norm"] == m_role["grad_norm"]
    t, r = _params(twin), _params(role)
    assert all(torch.equal(t[k], r[k]) for k in t), "training after reload diverged"


def _check_critic(root, batch, ref_values):
    """(d) critic values match TP1·PP1; value-loss steps lower the loss."""
    critic = _critic(root, 2, 2)
    values = critic.forward_only(batch)["values"]
    assert values.shape == (B, R) and torch.isfinite(values).all()
    _close("critic values TP2·PP2 vs TP1·PP1", values, ref_values, batch["response_mask"])
    packed = _critic(root, 2, 2, pack_sequences=True).forward_only(batch)["values"]
    _close("packed critic values vs TP1·PP1", packed, ref_values, batch["response_mask"])
    batch = dict(batch, old_values=values)
    losses = [critic.train_step(batch, _value_loss)["loss"] for _ in range(3)]
    assert losses[2] < losses[0], f"value loss did not decrease: {losses}"


def _body(rank: int, world_size: int, root) -> None:
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    batch = torch.load(root / "batch.pt")
    ref_norm = float(batch.pop("ref_grad_norm"))
    mask = batch["response_mask"]
    results = {}
    norm_errors = []
    for tp, pp, vpp in LAYOUTS:
        ps.destroy_model_parallel()
        ps.initialize_model_parallel(
            tp, pp, virtual_pipeline_model_parallel_size=vpp, order=MEGATRON_RANK_ORDER
        )
        model_parallel_cuda_manual_seed(0)
        layout = f"tp{tp}pp{pp}vpp{vpp or 1}"
        actor = _actor(root, tp, pp, vpp)
        out = actor.forward_only(batch, with_entropy=True)
        _close(f"{layout} log_prob vs transformers", out["log_prob"], batch["ref_log_prob"], mask)
        _close(f"{layout} entropy vs transformers", out["entropy"], batch["ref_entropy"], mask)
        if layout != "tp1pp1vpp1":
            _close(f"{layout} log_prob vs TP1", out["log_prob"], results["lp"], mask)
        if vpp:
            # Packed micro-batches keep one shape for the interleaved schedule.
            packed = _actor(root, tp, pp, vpp, pack_sequences=True).forward_only(batch)
            _close(f"{layout} packed log_prob", packed["log_prob"], batch["ref_log_prob"], mask)
        init = _params(actor)
        metrics = actor.train_step(_dp_rows(batch), _ppo_loss)
        assert metrics["grad_norm"] > 0.5, "grad clipping should be active in this test"
        if abs(metrics["grad_norm"] / ref_norm - 1) >= TOL:
            norm_errors.append(f"{layout}: {metrics['grad_norm']} vs transformers {ref_norm}")
        path = root / f"step_{layout}"
        path.mkdir(exist_ok=True)
        dist_checkpointing.save(_sharded(actor), str(path))
        if layout == "tp1pp1vpp1":
            results.update(lp=out["log_prob"], loss=metrics["loss"])
            results["values"] = _critic(root, 1, 1).forward_only(batch)["values"]
        else:
            loss_err = abs(metrics["loss"] - results["loss"])
            assert loss_err < 1e-5, f"{layout}: loss {metrics['loss']} vs {results['loss']}"
        if layout == "tp2pp2vpp1":
            _check_micro_batching(root, batch, _params(actor), init, ref_norm)
            _check_offload(root, batch)
            _check_critic(root, batch, results["values"])

    # Compare every layout's stepped weights in the TP1·PP1 layout.
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(1, 1, order=MEGATRON_RANK_ORDER)
    model_parallel_cuda_manual_seed(0)
    actor = _actor(root, 1, 1, None)
    init = _params(actor)

    def load(layout):
        loaded = dist_checkpointing.load(_sharded(actor), str(root / f"step_{layout}"))
        return {f"0.{k}": v.clone() for k, v in loaded["chunk0"].items()}

    ref = load("tp1pp1vpp1")
    assert ref.keys() == init.keys()
    for tp, pp, vpp in LAYOUTS[1:]:
        layout = f"tp{tp}pp{pp}vpp{vpp or 1}"
        _assert_same_update(f"{layout} vs TP1·PP1·DP4", init, ref, load(layout))
    assert not norm_errors, f"grad norms differ: {norm_errors}"


@pytest.mark.slow
def test_roles_across_layouts(tmp_path):
    _make_checkpoint(tmp_path)
    run_on_ranks(_body, world_size=4, root=tmp_path)


def test_lr_schedule():
    from rl_megatron.config import OptimConfig
    from rl_megatron.trainer.lr_schedule import lr_at

    warm = OptimConfig(lr=1.0, min_lr=0.1, lr_warmup_steps=4, lr_decay_style="cosine")
    assert [lr_at(s, warm, 14) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_at(4, warm, 14) == 1.0
    assert abs(lr_at(9, warm, 14) - 0.55) < 1e-12  # half-way: (1 + 0.1) / 2
    assert lr_at(14, warm, 14) == pytest.approx(0.1) and lr_at(99, warm, 14) == 0.1
    lin = OptimConfig(lr=1.0, lr_decay_style="linear", lr_decay_steps=10)
    assert lr_at(5, lin, None) == 0.5
    assert lr_at(7, OptimConfig(lr=0.3), None) == 0.3
    with pytest.raises(ValueError, match="lr_decay_steps"):
        lr_at(0, OptimConfig(lr_decay_style="cosine"), None)
