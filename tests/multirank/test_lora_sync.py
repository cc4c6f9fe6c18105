"""A LoRA MoE actor's weight sync sends its merged weights, experts included, on 2 gloo ranks.

One spawn: the tiny Qwen3-MoE of tests/reshard_refs.py (QK-norm, 4 experts per layer) is
built as an actor at TP1·EP2 (each rank holds two experts; EP over DP), TP2 and PP2, with
adapters on all four linear kinds (fc1 / fc2 on every expert) and the LM head, A and B on a dyadic grid so
that W + (alpha/r)·B·A is exact in any order. A `WeightSync` into `TensorStoreTarget`s of
vLLM's layout (NaN until written; in place, so the sync would keep copy views for a plain
actor) at every generation TP the plan block allows must hold, bit for bit, the HF checkpoint
merged by hand (q/k/v rows taken out of Megatron's per-group interleave by hand, fc1's B as
[gate; up]) sliced into vLLM's shards (`moe_vllm_reference`). Each pair is synced twice, B
redrawn in between (a merge kept from the first sync would show). After each sync: the
trainer's parameters are unchanged bit for bit, no merged tensor is alive any more (they are
temporaries of the sync), no copy view was kept, and `SyncStats.lora_merged_bytes` is the
bytes of the rank's adapted weights.

Tolerance: bit-exact.
"""

from __future__ import annotations

import gc
import weakref
import zlib

import pytest
import torch

from rl_megatron.parallel import ParallelLayout
from tests.reshard_refs import MOE_MODELS
from tests.spawn import ON_GPU, run_on_ranks

pytestmark = [pytest.mark.slow, pytest.mark.skipif(ON_GPU, reason="CPU (gloo) test")]

WORLD = 2
LAYOUTS = [(1, 1, 2), (2, 1, 1), (1, 2, 1)]  # (tp, pp, ep)
MODULES = ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2", "output_layer"]
RANK, ALPHA = 4, 8.0  # scale 2: exact
BUCKET_MB = 1 / 64


def _dyadic(shape: tuple[int, ...], std: float, grid: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.round(std * grid * torch.randn(shape, generator=gen)) / grid


def _full(key: str, shape_a: tuple[int, int], shape_b: tuple[int, int], draw: int):
    """(A, B) of adapter `key` in full ("{layer}.{module}" or "{layer}.{expert}.{module}")."""
    seed = zlib.crc32(key.encode())
    return _dyadic(shape_a, 0.1, 64, seed), _dyadic(shape_b, 0.05, 256, seed + 1000 * draw)


def _adapters(cfg: dict, draw: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    hidden, hd, ffn = cfg["hidden_size"], cfg["head_dim"], cfg["moe_intermediate_size"]
    heads, groups = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    out = {}
    for layer in range(cfg["num_hidden_layers"]):
        out[f"{layer}.linear_qkv"] = _full(
            f"{layer}.linear_qkv", (RANK, hidden), ((heads + 2 * groups) * hd, RANK), draw
        )
        out[f"{layer}.linear_proj"] = _full(
            f"{layer}.linear_proj", (RANK, heads * hd), (hidden, RANK), draw
        )
        for e in range(cfg["num_experts"]):
            key = f"{layer}.{e}"
            out[f"{key}.linear_fc1"] = _full(f"{key}.fc1", (RANK, hidden), (2 * ffn, RANK), draw)
            out[f"{key}.linear_fc2"] = _full(f"{key}.fc2", (RANK, ffn), (hidden, RANK), draw)
    # The LM head: one B row per token of the HF vocabulary (Megatron's padding rows get 0).
    out["output_layer"] = _full("output_layer", (RANK, hidden), (cfg["vocab_size"], RANK), draw)
    return out


def _hand_merged(state: dict, cfg: dict, adapters: dict) -> dict[str, torch.Tensor]:
    """The HF checkpoint with W + (alpha/r)·B·A in every adapted weight."""
    hd, groups = cfg["head_dim"], cfg["num_key_value_heads"]
    per_group = cfg["num_attention_heads"] // groups
    out = dict(state)

    def add(name: str, b: torch.Tensor, a: torch.Tensor) -> None:
        out[name] = state[name] + (b @ a) * (ALPHA / RANK)

    for key, (a, b) in adapters.items():
        *where, module = key.split(".")
        pre = f"model.layers.{where[0]}" if where else ""
        if module == "output_layer":
            add("lm_head.weight", b, a)
        elif module == "linear_qkv":
            rows = b.reshape(groups, per_group + 2, hd, RANK)
            add(f"{pre}.self_attn.q_proj.weight", rows[:, :per_group].reshape(-1, RANK), a)
            add(f"{pre}.self_attn.k_proj.weight", rows[:, per_group].reshape(-1, RANK), a)
            add(f"{pre}.self_attn.v_proj.weight", rows[:, per_group + 1].reshape(-1, RANK), a)
        elif module == "linear_proj":
            add(f"{pre}.self_attn.o_proj.weight", b, a)
        elif module == "linear_fc1":
            gate, up = b.chunk(2)
            add(f"{pre}.mlp.experts.{where[1]}.gate_proj.weight", gate, a)
            add(f"{pre}.mlp.experts.{where[1]}.up_proj.weight", up, a)
        else:
            add(f"{pre}.mlp.experts.{where[1]}.down_proj.weight", b, a)
    return out


def _shard(full: torch.Tensor, local: torch.Tensor, adapter, fc1_b: bool) -> torch.Tensor:
    """`full` cut like `local` (the adapter's split factor: B's rows, or A's columns)."""
    if full.shape == local.shape:
        return full
    dim = 0 if full.shape[0] != local.shape[0] else 1
    tp, rank = full.shape[dim] // local.shape[dim], adapter.tp_group.rank()
    if fc1_b:  # per TP shard: [gate_r; up_r]
        gate, up = full.chunk(2)
        return torch.cat([gate.chunk(tp)[rank], up.chunk(tp)[rank]])
    return full.chunk(tp, dim)[rank]


@torch.no_grad()
def _set_adapters(actor, adapters: dict) -> None:
    from megatron.core import parallel_state as ps

    from rl_megatron.checkpoint.hf_loader import unwrap
    from rl_megatron.models.lora import LoraAdapter

    for chunk in actor:
        head = getattr(unwrap(chunk), "output_layer_lora", None)
        if head is not None:  # the last stage's LM head: B padded to Megatron's vocabulary
            a, b = adapters["output_layer"]
            tp = head.tp_group.size() if head.tp_group is not None else 1
            padded = torch.zeros(head.lora_b.shape[0] * tp, RANK)
            padded[: b.shape[0]] = b
            head.lora_a.copy_(a)
            head.lora_b.copy_(_shard(padded, head.lora_b, head, False))
        for layer in unwrap(chunk).decoder.layers:
            for path, adapter in layer.named_modules():
                if not isinstance(adapter, LoraAdapter):
                    continue
                module = path.rsplit(".", 1)[-1].removesuffix("_lora")
                key = f"{layer.layer_number - 1}"
                if ".local_experts." in path:
                    local = int(path.split(".local_experts.")[1].split(".")[0])
                    per_rank = layer.mlp.experts.num_local_experts
                    key += f".{ps.get_expert_model_parallel_rank() * per_rank + local}"
                a, b = adapters[f"{key}.{module}"]
                adapter.lora_a.copy_(_shard(a, adapter.lora_a, adapter, False))
                adapter.lora_b.copy_(_shard(b, adapter.lora_b, adapter, module == "linear_fc1"))


def _body(rank: int, world_size: int, path: str, cfg: dict) -> None:
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from safetensors.torch import load_file

    from rl_megatron.checkpoint.hf_builders import build_actor
    from rl_megatron.models.hf_config import load_hf_config
    from rl_megatron.models.lora import adapters_of, apply_lora
    from rl_megatron.resharding import lora_merge
    from rl_megatron.resharding.layouts import (
        MEGATRON_RANK_ORDER,
        GenerationLayout,
        TrainingLayout,
    )
    from rl_megatron.resharding.plan import plan_block
    from rl_megatron.resharding.targets import TensorStoreTarget
    from rl_megatron.resharding.weight_sync import WeightSync
    from rl_megatron.rollout.vllm import specs as vllm_layout
    from tests.reshard_refs import assert_bit_exact, moe_vllm_reference

    info = load_hf_config(path)
    state = load_file(f"{path}/model.safetensors")
    drawn = {draw: _adapters(cfg, draw) for draw in (1, 2)}
    merged_states = {draw: _hand_merged(state, cfg, a) for draw, a in drawn.items()}
    # Every merge the sync makes, held weakly: all must be gone once it returns.
    made: list[weakref.ref] = []
    merge = lora_merge.merged_weight

    def recorded(weight, adapter):
        out = merge(weight, adapter)
        made.append(weakref.ref(out))
        return out

    lora_merge.merged_weight = recorded
    pairs = 0
    for tp, pp, ep in LAYOUTS:
        ps.destroy_model_parallel()
        ps.initialize_model_parallel(
            tp, pp, expert_model_parallel_size=ep, order=MEGATRON_RANK_ORDER
        )
        model_parallel_cuda_manual_seed(0)
        training = TrainingLayout(tp, pp, world_size // (tp * pp), ep=ep)
        actor = build_actor(path, ParallelLayout.from_megatron(), dtype=torch.float32)
        apply_lora(actor, rank=RANK, alpha=ALPHA, dropout=0.0, target_modules=MODULES, seed=0)
        for t_g in (t for t in (1, 2) if plan_block(training) % t == 0):
            gen = GenerationLayout(t_g, world_size)
            padded = vllm_layout.vllm_padded_vocab(info.vocab_size, t_g)
            gen_tp = gen.coordinates(rank)["gen_tp"]
            store = TensorStoreTarget(vllm_layout.vllm_specs, info, gen, rank, padded)
            sync = WeightSync(store, info=info, training=training, bucket_mb=BUCKET_MB)
            for draw in (1, 2):
                where = f"tp{tp} pp{pp} ep{ep} t_g={t_g} draw {draw}"
                _set_adapters(actor, drawn[draw])
                before = {n: p.clone() for c in actor for n, p in c.named_parameters()}
                made.clear()
                stats = sync.sync(actor, version=draw)
                want = moe_vllm_reference(merged_states[draw], info, t_g, gen_tp, padded)
                assert_bit_exact(store.tensors, want, where)
                for name, p in (n_p for c in actor for n_p in c.named_parameters()):
                    assert torch.equal(p, before[name]), f"{where}: trainer's {name} changed"
                gc.collect()
                assert made and all(ref() is None for ref in made), f"{where}: merges kept"
                assert sync._views is not None and sync._views.bound == [], where
                # The merges' bytes: every adapted weight of this rank, once.
                adapted = {id(a.base().weight): a.base().weight for a in adapters_of(actor)}
                assert stats.lora_merged_bytes == sum(w.nbytes for w in adapted.values()) > 0
            pairs += 1
    assert pairs >= len(LAYOUTS), pairs


def test_lora_moe_actor_sync_sends_merged_weights_in_every_layout(tmp_path):
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    cfg = dict(MOE_MODELS["qwen3_moe"])
    cfg.pop("model_type")
    torch.manual_seed(3)
    AutoModelForCausalLM.from_config(Qwen3MoeConfig(**cfg)).save_pretrained(tmp_path / "moe")
    cfg["head_dim"] = Qwen3MoeConfig(**cfg).head_dim
    run_on_ranks(_body, world_size=WORLD, path=str(tmp_path / "moe"), cfg=cfg)
