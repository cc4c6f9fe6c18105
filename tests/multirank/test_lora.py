"""LoRA on the actor (`models/lora.py`): exactness against the base, what trains, layouts agree.

One 2-rank spawn walks TP1·DP2, TP2, TP2 with sequence parallelism (forward only: the CPU
build has no sequence-parallel backward) and PP2 on the tiny Llama of test_roles (fp32).
In each:
  (a) the LoRA actor with B = 0 gives the base actor's log-probs bit for bit;
  (b) with B perturbed (the same full B in every layout, sliced like the base weight's rows)
      the log-probs move, and with the adapters disabled — and through `BaseReference`, the
      reference of a LoRA run — they are the base's again, bit for bit;
  (c) the adapted log-probs equal TP1's (1e-4, test_roles' parity bound);
  (d) a base actor with W + (alpha/r)·B·A merged in by hand gives the adapted log-probs
      (1e-5), `merged_weight` equals that merge bit for bit, and so does the HF export
      (`iter_hf_tensors`) of the LoRA actor, tensor by tensor, with no adapter in it;
  (e) after one PPO step every base tensor is bit-identical, every adapter tensor moved (A
      too: B is nonzero), only adapters have a gradient buffer, and the optimizer's state
      holds exactly the adapters' elements (summed over its DP shards); at TP1 three more
      steps on the same batch lower its loss (the adapters' gradient descends);
  (f) the loss (1e-5 absolute) and grad norm (1e-4 relative) equal TP1's, and each adapter's
      update, gathered to its full shape, is within 1e-4 of its largest of TP1's (the
      tolerances and the Adam argument of test_roles: equal updates mean equal gradients);
  (g) each layout's dist_checkpointing save loads into TP1 with the same adapter tensors,
      bit for bit (the split factor's global layout is the same at any TP).
"""

from __future__ import annotations

import zlib

import pytest
import torch

from rl_megatron.parallel import MEGATRON_RANK_ORDER, ParallelGroups, ParallelLayout
from tests.multirank.test_roles import (
    TEMPERATURE,
    V,
    _dp_rows,
    _make_checkpoint,
    _optim,
    _ppo_loss,
    _sharded,
)
from tests.spawn import require_ranks, run_on_ranks

LAYOUTS = [(1, 1, False), (2, 1, False), (2, 1, True), (1, 2, False)]
MODULES = ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2", "output_layer"]
RANK, ALPHA, TOL = 4, 8.0, 1e-4


def _actor(root, lora: bool, sp: bool = False):
    from rl_megatron.checkpoint.hf_builders import build_actor
    from rl_megatron.models.lora import apply_lora
    from rl_megatron.trainer.roles import MegatronRole

    layout = ParallelLayout.from_megatron(sequence_parallel=sp)
    chunks = build_actor(root / "llama", layout, dtype=torch.float32)
    if lora:
        apply_lora(chunks, rank=RANK, alpha=ALPHA, dropout=0.0, target_modules=MODULES, seed=0)
    groups = ParallelGroups.from_megatron(layout)
    return MegatronRole(
        chunks, optim=_optim(), temperature=TEMPERATURE, micro_batch_size=2, groups=groups
    )


def _adapters(role) -> dict:
    """Global name → adapter module, e.g. `2.mlp.linear_fc1_lora`."""
    from rl_megatron.models.lora import LoraAdapter

    out = {}
    for chunk in role.model:
        layers = chunk.module.decoder.layers
        for name, module in chunk.module.named_modules():
            if name == "output_layer_lora":  # the LM head's (last stage)
                out["head"] = module
            elif isinstance(module, LoraAdapter):
                i, rest = name.split(".", 3)[2:]
                out[f"{layers[int(i)].layer_number - 1}.{rest}"] = module
    return out


def _shards(full: torch.Tensor, name: str, tp: int) -> list[torch.Tensor]:
    """A column layer's full B (TP1 row order) as its TP shards: fc1 is [gate; up] per shard."""
    if "linear_fc1" in name:
        gate, up = full.chunk(2)
        return [torch.cat(pair) for pair in zip(gate.chunk(tp), up.chunk(tp))]
    return list(full.chunk(tp))


@torch.no_grad()
def _perturb_b(role, tp: int, tp_rank: int) -> None:
    for name, a in _adapters(role).items():
        rows = a.lora_b.shape[0] * (tp if a.mode == "column" else 1)
        gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
        full = 0.05 * torch.randn(rows, RANK, generator=gen)
        local = _shards(full, name, tp)[tp_rank] if a.mode == "column" else full
        a.lora_b.copy_(local)


def _gathered(role, tp: int) -> dict[str, torch.Tensor]:
    """Each adapter tensor in its full TP1 shape (fc1's B back to [gate; up])."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    out = {}
    for name, a in sorted(_adapters(role).items()):
        for leaf, p in (("a", a.lora_a), ("b", a.lora_b)):
            t = p.detach().clone()
            split = (a.mode == "column") == (leaf == "b")
            if tp > 1 and split:
                parts = [torch.empty_like(t) for _ in range(tp)]
                dist.all_gather(parts, t, group=ps.get_tensor_model_parallel_group())
                if "linear_fc1" in name:
                    gates, ups = zip(*(x.chunk(2) for x in parts))
                    t = torch.cat(gates + ups)
                else:
                    t = torch.cat(parts, dim=0 if leaf == "b" else 1)
            # The head's B: the vocabulary's rows only (the padding grows with TP).
            out[f"{name}.{leaf}"] = t[:V] if (name, leaf) == ("head", "b") else t
    return out


def _norms_for_sequence_parallel() -> None:
    """megatron-core's torch norms refuse sequence parallelism (TE's take it); the same
    RMSNorm, its weight marked `sequence_parallel` as TE marks it, lets the CPU build run it."""
    from megatron.core.transformer import torch_norm

    def new(cls, config, hidden_size, eps=1e-5, **_):
        norm = torch.nn.RMSNorm(hidden_size, eps=eps)
        norm.weight.sequence_parallel = config.sequence_parallel
        return norm

    torch_norm.WrappedTorchNorm.__new__ = new


def _check_merge(root, batch, actor, moved, layout, sp) -> None:
    """(e) W + (alpha/r)·B·A merged by hand into a plain base actor gives the adapted
    log-probs (1e-5: fp32 summation order), and `merged_weight` is that merge bit for bit."""
    from rl_megatron.checkpoint.hf_export import iter_hf_tensors
    from rl_megatron.models.hf_config import load_hf_config
    from rl_megatron.models.lora import LoraAdapter, merged_weight

    base = _actor(root, lora=False, sp=sp)
    for chunk, plain in zip(actor.model, base.model):
        for name, a in chunk.module.named_modules():
            if not isinstance(a, LoraAdapter):
                continue
            weight = plain.module.get_submodule(name.removesuffix("_lora")).weight
            with torch.no_grad():
                by_hand = weight + (ALPHA / RANK) * (a.lora_b @ a.lora_a)
                assert torch.equal(merged_weight(weight, a), by_hand), f"{layout}: {name}"
                weight.copy_(by_hand)
    # The HF export merges on the fly: the LoRA actor exports the hand-merged weights.
    info = load_hf_config(root / "llama")
    mine = dict(iter_hf_tensors(actor.model, info, actor.groups))
    theirs = dict(iter_hf_tensors(base.model, info, base.groups))
    assert mine.keys() == theirs.keys() and not any("lora" in k for k in mine), layout
    for name, tensor in theirs.items():
        assert torch.equal(mine[name], tensor), f"{layout}: HF export of {name}"
    err = base.forward_only(batch)["log_prob"] - moved
    assert err[batch["response_mask"].bool()].abs().max() < 1e-5, (
        f"{layout}: the merged model's log-probs differ"
    )


def _body(rank, world_size, root):
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from rl_megatron.models.lora import adapters_disabled
    from rl_megatron.trainer.base_reference import BaseReference

    batch = torch.load(root / "batch.pt")
    batch.pop("ref_grad_norm")
    mask = batch["response_mask"].bool()
    _norms_for_sequence_parallel()
    for tp, pp, sp in LAYOUTS:
        ps.destroy_model_parallel()
        ps.initialize_model_parallel(tp, pp, order=MEGATRON_RANK_ORDER)
        model_parallel_cuda_manual_seed(0)
        layout, tp_rank = f"tp{tp}pp{pp}sp{int(sp)}", ps.get_tensor_model_parallel_rank()
        base_lp = _actor(root, lora=False, sp=sp).forward_only(batch)["log_prob"]
        actor = _actor(root, lora=True, sp=sp)
        # (a) B = 0: the base model, bit for bit.
        assert torch.equal(actor.forward_only(batch)["log_prob"], base_lp), layout
        # (b) a nonzero B moves the policy; disabled adapters give the base back exactly.
        _perturb_b(actor, tp, tp_rank)
        moved = actor.forward_only(batch)["log_prob"]
        assert (moved - base_lp)[mask].abs().max() > 1e-3, f"{layout}: B did not act"
        with adapters_disabled(actor.model):
            assert torch.equal(actor.forward_only(batch)["log_prob"], base_lp), layout
        ref = BaseReference(actor, micro_batch_size=2).forward_only(batch)["log_prob"]
        assert torch.equal(ref, base_lp), f"{layout}: reference is not the base"
        assert torch.equal(actor.forward_only(batch)["log_prob"], moved), "left disabled"
        # The log-probs from the hidden states (`logprob_chunk_tokens`, the trainer's default)
        # take the head's adapter through its weight, not through the layer's hook.
        actor.logprob_chunk_tokens = 7
        chunked = actor.forward_only(batch)["log_prob"]
        assert (chunked - moved)[mask].abs().max() < 1e-5, f"{layout}: chunked log-probs"
        # (c) the same adapted policy in every layout.
        if tp == 1 and pp == 1:
            moved_tp1 = moved
        err = (moved - moved_tp1)[mask].abs().max().item()
        assert err < TOL, f"{layout}: adapted log-probs differ from TP1's by {err:.2e}"
        _check_merge(root, batch, actor, moved, layout, sp)  # (d)
        if sp:
            # The CPU build cannot run a sequence-parallel backward (megatron-core's
            # reduce-scatter allocates on CUDA there): the forward only.
            continue
        # (e) one step: only adapters change, only they have buffers and optimizer state.
        adapter_ids = {id(p) for a in _adapters(actor).values() for p in a.parameters()}
        params = [(n, p) for c in actor.model for n, p in c.module.named_parameters()]
        before = {n: p.detach().clone() for n, p in params}
        start = _gathered(actor, tp)
        metrics = actor.train_step(_dp_rows(batch), _ppo_loss)
        for n, p in params:
            is_adapter = id(p) in adapter_ids
            assert hasattr(p, "main_grad") == is_adapter, f"{layout}: {n} grad buffer"
            moves = is_adapter
            if n == "output_layer_lora.lora_b":
                # Rows of padding ids get no gradient; at TP2 one shard holds only those.
                first = tp_rank * p.shape[0]
                real = max(0, min(V - first, p.shape[0]))
                assert torch.equal(p.detach()[real:], before[n][real:]), f"{layout}: padding"
                moves = real > 0
            same = torch.equal(p.detach(), before[n])
            assert same != moves, f"{layout}: {n} {'unchanged' if same else 'changed'}"
        state = sum(
            s["exp_avg"].numel()
            for opt in getattr(actor.optimizer, "chained_optimizers", [actor.optimizer])
            for s in opt.optimizer.state.values()
        )
        total = torch.tensor(float(state))
        torch.distributed.all_reduce(total, group=ps.get_data_parallel_group())
        adapter_numel = sum(p.numel() for n, p in params if id(p) in adapter_ids)
        assert total.item() == adapter_numel, f"{layout}: optimizer state {total} elements"
        # (f) this layout's step, for the comparison with TP1 after the spawn.
        after = _gathered(actor, tp)
        update = {k: v - start[k] for k, v in after.items()}
        dist_checkpointing.save(_sharded(actor), str(_fresh(root / f"ckpt_{layout}")))
        if tp_rank == 0 and ps.get_data_parallel_rank() == 0:
            out = {"loss": metrics["loss"], "grad_norm": metrics["grad_norm"], **update}
            torch.save(
                after, root / f"after_{layout}_stage{ps.get_pipeline_model_parallel_rank()}.pt"
            )
            torch.save(out, root / f"{layout}_stage{ps.get_pipeline_model_parallel_rank()}.pt")
        if tp == 1 and pp == 1:
            # The adapters' gradient descends: more steps on the same batch lower its loss.
            again = [actor.train_step(_dp_rows(batch), _ppo_loss)["loss"] for _ in range(3)]
            assert again[-1] < metrics["loss"] - 1e-3, f"loss {metrics['loss']} -> {again}"
        torch.distributed.barrier()
    # (g) each layout's checkpoint loads into TP1 with the adapters it saved, bit for bit:
    # B sharded like the weight's rows (fc1 as [gate; up]), A like the input's columns.
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(1, 1, order=MEGATRON_RANK_ORDER)
    model_parallel_cuda_manual_seed(0)
    actor = _actor(root, lora=True)
    for tp, pp, sp in LAYOUTS:
        if sp:
            continue
        layout = f"tp{tp}pp{pp}sp{int(sp)}"
        loaded = dist_checkpointing.load(_sharded(actor), str(root / f"ckpt_{layout}"))
        saved = {}
        for stage in range(pp):
            saved.update(torch.load(root / f"after_{layout}_stage{stage}.pt"))
        # At TP1·PP1 the local layer index is the global one.
        chunk = loaded["chunk0"]
        prefix = {n: "output_layer_lora." if n == "head" else f"decoder.layers.{n}."
                  for n in _adapters(actor)}  # fmt: skip
        got = {f"{n}.{leaf}": chunk[f"{prefix[n]}lora_{leaf}"]
               for n in _adapters(actor) for leaf in ("a", "b")}  # fmt: skip
        got["head.b"] = got["head.b"][:V]
        assert got.keys() == saved.keys()
        for key, value in saved.items():
            assert torch.equal(got[key], value), f"{layout} checkpoint: {key}"
    ps.destroy_model_parallel()


def _fresh(path):
    path.mkdir(exist_ok=True)
    return path


def _load(root, tp, pp, sp) -> dict:
    out = {}
    for stage in range(pp):
        out.update(torch.load(root / f"tp{tp}pp{pp}sp{int(sp)}_stage{stage}.pt"))
    return out


def test_lora_across_layouts(tmp_path):
    require_ranks(2)
    _make_checkpoint(tmp_path)
    run_on_ranks(_body, world_size=2, root=tmp_path)
    ref = _load(tmp_path, 1, 1, False)
    adapters = [k for k in ref if k not in ("loss", "grad_norm")]
    assert len(adapters) == (4 * 4 + 1) * 2  # 4 layers × 4 modules and the head × (A, B)
    for tp, pp, sp in [layout for layout in LAYOUTS[1:] if not layout[2]]:
        got, layout = _load(tmp_path, tp, pp, sp), f"tp{tp}pp{pp}sp{int(sp)}"
        assert abs(got["loss"] - ref["loss"]) < 1e-5, f"{layout} loss"
        assert abs(got["grad_norm"] / ref["grad_norm"] - 1) < TOL, f"{layout} grad norm"
        assert sorted(got) == sorted(ref)
        for key in adapters:
            assert got[key].shape == ref[key].shape, key
            scale = ref[key].abs().max()
            err = ((got[key] - ref[key]).abs().max() / scale).item()
            assert err < TOL, f"{layout}: {key} differs by {err:.2e} of its largest"


# ------------------------------------------------------------------------- experts


def _expert_global(role) -> dict:
    """`_adapters` with each expert's local index made global (rank r of the EP group holds
    experts [r·n, (r+1)·n))."""
    out = {}
    for name, a in _adapters(role).items():
        head, sep, tail = name.partition(".local_experts.")
        if sep:
            local, _, rest = tail.partition(".")
            experts = next(
                m
                for m in role.model[0].module.modules()
                if hasattr(m, "num_local_experts") and hasattr(m, "ep_group")
            )
            glob = experts.ep_group.rank() * experts.num_local_experts + int(local)
            name = f"{head}.local_experts.{glob}.{rest}"
        out[name] = a
    return out


def _moe_body(rank, world_size, root):
    from megatron.core import dist_checkpointing

    from rl_megatron.checkpoint.hf_builders import build_actor
    from rl_megatron.models.lora import apply_lora
    from rl_megatron.trainer.roles import MegatronRole
    from tests.multirank import test_moe as tm
    from tests.multirank import test_roles as tr

    batch = tr._batch()

    def actor(lora: bool):
        chunks = build_actor(
            root / "qwen3_moe", ParallelLayout.from_megatron(), dtype=torch.float32
        )
        if lora:
            apply_lora(chunks, rank=RANK, alpha=ALPHA, dropout=0.0, target_modules=MODULES, seed=0)
        return MegatronRole(chunks, optim=_optim(), temperature=TEMPERATURE, micro_batch_size=2)

    @torch.no_grad()
    def perturb(role):
        for name, a in _expert_global(role).items():
            gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
            a.lora_b.copy_(0.05 * torch.randn(a.lora_b.shape, generator=gen))

    def adapters(state: dict) -> dict:
        # A saved ShardedTensor (or fc1's swiglu factory) holds this rank's tensor as `data`.
        chunk = state["chunk0"]
        return {k: getattr(v, "data", v).clone() for k, v in chunk.items() if ".lora_" in k}

    for ep in (1, 2):
        tm._init(1, 1, ep, 1)
        base_lp = actor(lora=False).forward_only(batch)["log_prob"]
        role = actor(lora=True)
        assert torch.equal(role.forward_only(batch)["log_prob"], base_lp), f"ep{ep}: B = 0"
        assert any("local_experts" in n for n in _expert_global(role)), "experts not adapted"
        perturb(role)
        lp = role.forward_only(batch)["log_prob"]
        if ep == 1:
            lp_ep1 = lp
            noise = 0.3 * torch.randn(lp.shape, generator=torch.Generator().manual_seed(5))
            batch["old_log_prob"] = torch.where(batch["response_mask"].bool(), lp + noise, 0.0)
        mask = batch["response_mask"].bool()
        assert (lp - lp_ep1)[mask].abs().max() < TOL, f"ep{ep}: adapted log-probs differ"
        role.train_step(tr._dp_rows(batch), tr._ppo_loss)
        path = root / f"moe_ep{ep}"
        path.mkdir(exist_ok=True)
        dist_checkpointing.save(_sharded(role), str(path))

    tm._init(1, 1, 1, 1)
    role = actor(lora=True)
    perturb(role)
    init = adapters(_sharded(role))
    ep1 = adapters(dist_checkpointing.load(_sharded(role), str(root / "moe_ep1")))
    ep2 = adapters(dist_checkpointing.load(_sharded(role), str(root / "moe_ep2")))
    assert init.keys() == ep1.keys() == ep2.keys() and any("experts" in k for k in init)
    for key in init:
        d1, d2 = ep1[key] - init[key], ep2[key] - init[key]
        scale = d1.abs().max()
        assert scale > 0, f"{key} did not move at EP1"
        err = ((d1 - d2).abs().max() / scale).item()
        assert err < TOL, f"EP2 vs EP1: update of {key} differs by {err:.2e} of its largest"


@pytest.mark.slow
def test_lora_moe_ep2_equals_ep1(tmp_path):
    """An MoE actor (tiny Qwen3-MoE of test_moe, LoRA on attention and every expert's fc1 /
    fc2): B = 0 is the base bit for bit at EP1 and EP2; with B perturbed (the same per global
    expert) the log-probs agree (1e-4) and one step's adapter updates, saved with
    dist_checkpointing at each EP and loaded at EP1, agree (1e-4 of the largest, test_roles)."""
    from tests.multirank import test_moe as tm

    require_ranks(2)
    tm._make_checkpoints(tmp_path)
    run_on_ranks(_moe_body, world_size=2, root=tmp_path)
