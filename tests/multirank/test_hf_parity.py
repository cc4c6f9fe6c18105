"""HF ⇄ Megatron: logits match `transformers`, and HF → Megatron → HF is bit-identical.

Four tiny random HF models are created in the test (no downloads), each with every weight
perturbed away from its default init (norms ≠ 1, QKV biases ≠ 0), so a swapped or dropped
tensor changes the logits:

* Llama with GQA (4 heads, 2 KV heads) and Llama 3.1 rope scaling (theta 5e5, factor 8),
* Qwen2 with QKV bias and tied embeddings,
* Mistral with an explicit head_dim (32 ≠ hidden/heads) and a sliding window (8 < seq 16),
* Qwen3 with QK-norm (q_norm ≠ k_norm, each ≠ 1), an explicit head_dim (32 ≠ hidden/heads),
  tied embeddings and rope theta 1e6.

Vocab 100 is padded to 128 (TP1) or 256 (TP2: rank 1 holds padding rows only).

One 4-rank spawn walks the layouts TP1·PP1, TP2·PP1, TP1·PP2, TP2·PP2 and TP1·PP2·VPP2.
In each, every family is built and loaded straight from safetensors (`hf_loader`) and run
forward through Megatron's pipeline schedule (2 micro-batches of 2), without and with
padding (left and right, `causal_padding_mask`). At TP2·PP2 and TP1·PP2·VPP2 each model is
exported back (`hf_export`) and compared tensor by tensor with the source. At TP2·PP2 a
reward model (LlamaForSequenceClassification) and critics are checked too.

Tolerances: logits within 1e-4 max abs of the transformers fp32 forward (the issue's bound;
observed ~1e-6: only summation order differs — TP-split matmuls, SDPA vs eager attention).
Round trips: bit-identical (torch.equal, same dtype, same tensor names).

In cuda mode (tests/spawn.py) Megatron runs in bf16 on the ranks' GPUs. The checkpoints are
then saved in bf16 and the reference is transformers' fp32 forward of those same bf16
weights (upcasting is exact), so the logit error is bf16 activation rounding alone and the
round trips stay bit-identical. Logits must lie within LOGIT_RTOL_BF16 = 2^-4 of the
reference's largest |logit|: bf16 keeps 8 significant bits (each rounding is within 2^-9
relative), and a forward of these 4-layer models rounds about 32 tensors in sequence
(embedding; per layer norm, QKV, attention, projection, residual, norm, gate/up, down,
residual; final norm, head), so 32 · 2^-9 = 2^-4 bounds the accumulated relative error. A
bf16 CPU forward of the same models measures 1.3-1.6 %, a quarter of that; a wrong or
swapped tensor moves logits by O(100 %). On 2 GPUs the layouts that fit 2 ranks run
(TP1·PP1, TP2·PP1, TP1·PP2, TP1·PP2·VPP2); export and the value models move to TP2·PP1.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from rl_megatron.parallel import MEGATRON_RANK_ORDER, ParallelGroups, ParallelLayout
from tests.spawn import ON_GPU, max_ranks, run_on_ranks, test_device

V, S, B, MICRO = 100, 16, 4, 2
FAMILIES = ("llama", "qwen2", "mistral", "qwen3")
LOGIT_TOL = 1e-4  # fp32, max abs
LOGIT_RTOL_BF16 = 2.0**-4  # bf16 (cuda mode), times the reference's max |logit|
DTYPE = torch.bfloat16 if ON_GPU else torch.float32
WORLD = min(4, max_ranks())
LAYOUTS = [
    (tp, pp, vpp)
    for tp, pp, vpp in [(1, 1, None), (2, 1, None), (1, 2, None), (2, 2, None), (1, 2, 2)]
    if tp * pp <= WORLD
]
# Where models are exported back to HF, and where the value models are checked: the
# largest layouts that fit (TP2·PP2 on 4 ranks).
EXPORT_LAYOUTS = {(2, 2, None), (1, 2, 2)} if WORLD >= 4 else {(2, 1, None), (1, 2, 2)}
VALUE_LAYOUT = (2, 2, None) if WORLD >= 4 else (2, 1, None)


def _hf_models():
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    common = dict(
        vocab_size=V,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
    )
    llama3 = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    return {
        "llama": LlamaConfig(
            **common, rope_theta=500000.0, rope_scaling=llama3, max_position_embeddings=16384
        ),
        "qwen2": Qwen2Config(**common, tie_word_embeddings=True),
        "mistral": MistralConfig(**common, head_dim=32, sliding_window=8),
        "qwen3": Qwen3Config(**common, head_dim=32, tie_word_embeddings=True, rope_theta=1e6),
    }


def _perturb(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + 0.1 * noise if "norm" in name else 0.1 * noise)


def _inputs():
    gen = torch.Generator().manual_seed(11)
    ids = torch.randint(1, V, (B, S), generator=gen)
    mask = torch.ones(B, S, dtype=torch.long)
    mask[0, :3] = 0  # left padding
    mask[1, -5:] = 0  # right padding
    mask[2, :1] = 0
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    return ids, mask, pos


def _make_checkpoints(root):
    """Save the HF models, a reward model, and the transformers reference outputs."""
    from transformers import AutoModelForCausalLM, LlamaForSequenceClassification

    ids, mask, pos = _inputs()
    refs = {}
    for seed, (family, cfg) in enumerate(_hf_models().items()):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()
        _perturb(model, seed)
        model.to(DTYPE).save_pretrained(root / family, safe_serialization=True)
        model.float()  # the fp32 reference of the saved (possibly bf16-rounded) weights
        with torch.no_grad():
            refs[family] = (
                model(ids).logits,
                model(ids, attention_mask=mask, position_ids=pos).logits,
            )
    cfg = _hf_models()["llama"]
    cfg.num_labels, cfg.pad_token_id = 1, 0
    torch.manual_seed(7)
    reward = LlamaForSequenceClassification(cfg).eval()
    _perturb(reward, 7)
    reward.to(DTYPE).save_pretrained(root / "reward", safe_serialization=True)
    reward.float()
    with torch.no_grad():
        refs["reward"] = reward(ids).logits[:, 0]  # ids hold no pad token: last position
    torch.save(refs, root / "refs.pt")


def _forward(chunks, ids, pos, mask):
    """Megatron forward through the pipeline schedule; [B, S, out/tp] on the last stage."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from rl_megatron.models.sdpa_attention import causal_padding_mask

    attn = causal_padding_mask(mask) if mask is not None else None
    micro = [
        (ids[i : i + MICRO], pos[i : i + MICRO], attn[i : i + MICRO] if attn is not None else None)
        for i in range(0, B, MICRO)
    ]

    def step(data_iterator, model):
        i, p, a = next(data_iterator)
        return model(i, p, a), None

    iters = [iter(micro) for _ in chunks]
    with torch.no_grad():
        outs = get_forward_backward_func()(
            forward_step_func=step,
            data_iterator=iters if len(chunks) > 1 else iters[0],
            model=chunks,
            num_microbatches=B // MICRO,
            seq_length=S,
            micro_batch_size=MICRO,
            forward_only=True,
        )
    return torch.cat(outs) if outs else None


def _gather_vocab(logits):
    from megatron.core import parallel_state as ps

    group = ps.get_tensor_model_parallel_group()
    parts = [torch.empty_like(logits) for _ in range(group.size())]
    torch.distributed.all_gather(parts, logits.contiguous(), group=group)
    return torch.cat(parts, dim=-1)[..., :V]  # padded ids never reach a comparison


def _check_logits(what, got, ref, mask=None):
    """`got` (any device, DTYPE) against the fp32 CPU reference; `mask` [B, S] selects."""
    diff = (got.float().cpu() - ref).abs()
    if mask is not None:
        diff = diff[mask.bool()]
    err = diff.max().item()
    tol = LOGIT_RTOL_BF16 * ref.abs().max().item() if ON_GPU else LOGIT_TOL
    assert err < tol, f"{what}: max abs logit error {err:.2e} >= {tol:.2e} ({DTYPE})"


def _check_round_trip(src, out):
    if torch.distributed.get_rank() != 0:
        return
    a, b = _load_dir(src), _load_dir(out)
    assert a.keys() == b.keys(), f"{out}: names differ: {sorted(a.keys() ^ b.keys())}"
    for name in a:
        assert a[name].dtype == b[name].dtype, f"{out}: {name} dtype"
        assert torch.equal(a[name], b[name]), f"{out}: {name} is not bit-identical"


def _load_dir(path):
    tensors = {}
    for f in sorted(path.glob("*.safetensors")):
        tensors.update(load_file(f))
    return tensors


def _body(rank: int, world_size: int, root) -> None:
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from rl_megatron.checkpoint.hf_builders import build_actor
    from rl_megatron.checkpoint.hf_export import save_hf_checkpoint
    from rl_megatron.models.hf_config import load_hf_config

    refs = torch.load(root / "refs.pt")
    device = test_device()
    ids, mask, pos = (t.to(device) for t in _inputs())
    for tp, pp, vpp in LAYOUTS:
        ps.destroy_model_parallel()
        ps.initialize_model_parallel(
            tp, pp, virtual_pipeline_model_parallel_size=vpp, order=MEGATRON_RANK_ORDER
        )
        model_parallel_cuda_manual_seed(0)
        layout = f"tp{tp}pp{pp}vpp{vpp or 1}"
        for family in FAMILIES:
            chunks = build_actor(root / family, ParallelLayout.from_megatron(), dtype=DTYPE)
            ref_plain, ref_pad = refs[family]
            plain_pos = torch.arange(S, device=device).expand(B, S)
            plain = _forward(chunks, ids, pos=plain_pos, mask=None)
            padded = _forward(chunks, ids, pos=pos, mask=mask)
            if ps.is_pipeline_last_stage():
                assert plain.shape[-1] * tp == (128 if tp == 1 else 256)
                _check_logits(f"{family} {layout}", _gather_vocab(plain), ref_plain)
                padded = _gather_vocab(padded)
                _check_logits(f"{family} {layout} padded", padded, ref_pad, mask.cpu())
            if (tp, pp, vpp) in EXPORT_LAYOUTS:
                out = root / f"export_{family}_{layout}"
                save_hf_checkpoint(
                    chunks,
                    load_hf_config(root / family),
                    out,
                    ParallelGroups.from_megatron(),
                    src_dir=root / family,
                )
                _check_round_trip(root / family, out)
        if (tp, pp, vpp) == VALUE_LAYOUT:
            _check_value_models(root, refs["reward"], ids, tp, pp)


def _check_value_models(root, ref_reward, ids, tp, pp):
    from megatron.core import parallel_state as ps

    from rl_megatron.checkpoint.hf_builders import build_critic, build_reward_model
    from rl_megatron.checkpoint.hf_export import save_hf_checkpoint
    from rl_megatron.models.hf_config import load_hf_config

    pos = torch.arange(S, device=ids.device).expand(B, S)
    layout = ParallelLayout.from_megatron()
    reward = build_reward_model(root / "reward", layout, dtype=DTYPE)
    from_reward = build_critic(root / "reward", layout, init_from="reward", dtype=DTYPE)
    fresh = build_critic(root / "llama", layout, init_from="actor", dtype=DTYPE)
    assert not any(p.requires_grad for p in reward[0].parameters())
    assert all(p.requires_grad for p in fresh[0].parameters())
    values = [_forward(m, ids, pos, None) for m in (reward, from_reward, fresh)]
    if ps.is_pipeline_last_stage():
        for v in values:
            assert v.shape == (B, S, 1) and torch.isfinite(v).all()
        _check_logits("reward model", values[0][:, -1, 0], ref_reward)
        _check_logits("critic from reward", values[1][:, -1, 0], ref_reward)
        # The fresh head is seeded, not drawn from the TP rank's RNG: replicas agree.
        head = fresh[0].output_layer.weight.detach()
        parts = [torch.empty_like(head) for _ in range(2)]
        torch.distributed.all_gather(parts, head, group=ps.get_tensor_model_parallel_group())
        assert torch.equal(parts[0], parts[1]) and head.abs().sum() > 0
    out = root / "export_reward"
    groups = ParallelGroups.from_megatron()
    save_hf_checkpoint(
        reward, load_hf_config(root / "reward"), out, groups, src_dir=root / "reward", head="value"
    )
    _check_round_trip(root / "reward", out)


@pytest.mark.slow
def test_hf_parity_and_round_trip(tmp_path):
    _make_checkpoints(tmp_path)
    # Qwen2's and Qwen3's tied heads: transformers writes the embedding only, and so must
    # the export.
    for family in ("qwen2", "qwen3"):
        assert "lm_head.weight" not in _load_dir(tmp_path / family)
    run_on_ranks(_body, world_size=WORLD, root=tmp_path)
