"""Each family's name table agrees with the model megatron-core builds, at TP=2 (2 ranks).

megatron-core marks a tensor-parallel parameter `tensor_model_parallel=True` with the dim
it splits (`partition_dim`); a replicated one (norms, the value head) is unmarked or marked
False. For every family in `models/families/` — untied and tied LM head, and the value
head of a critic / reward model — the model is built at TP=2 both ways the project builds
one: randomly initialised (megatron-core's initialisers set the attributes) and for loading
(no init; `mark_tensor_parallel_weights` sets them, as `checkpoint/hf_builders` does).
Every parameter must have a row (the loader's own lookup, `iter_rule_params`), the row's
`tp_dim` must equal the parameter's `partition_dim` (None: replicated), and every row of
the model must have its parameter.

A replicated row must also stay replicated in training: after one backward through
megatron-core's DDP and `finalize_model_grads` (what the roles run), each family's untied
LM has the same gradient on both TP ranks for every row with `tp_dim` None. Qwen3's
q/k layernorms see only their rank's heads, so their partial gradients must be summed over
TP — megatron-core does it when `TransformerConfig.qk_layernorm` is set. The MoE families
(experts split over expert-TP = TP here, the router replicated) are checked for their
attributes only: megatron-core trains an MoE layer at TP > 1 only with sequence parallelism.

Tolerance: none; attributes and names are compared exactly, gradients bit for bit (an
all-reduce leaves the same bits on every rank; the other replicated gradients are computed
from identical inputs).
"""

from __future__ import annotations

from rl_megatron.parallel import MEGATRON_RANK_ORDER, ParallelLayout
from tests.spawn import run_on_ranks

TP = 2
_BASE = dict(
    vocab_size=100,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)
# Both spellings of the expert count (Qwen3-MoE's num_experts, Mixtral's num_local_experts).
_MOE = dict(num_experts=4, num_local_experts=4, num_experts_per_tok=2, moe_intermediate_size=48)


def _variants():
    """(label, HF config, head) for every family: untied LM, tied LM, value head."""
    from rl_megatron.models.families import FAMILIES

    for model_type, table in FAMILIES.items():
        base = dict(_BASE, model_type=model_type, **(_MOE if table.moe else {}))
        yield f"{model_type}/lm", dict(base, tie_word_embeddings=False), "lm"
        yield f"{model_type}/tied", dict(base, tie_word_embeddings=True), "lm"
        yield f"{model_type}/value", dict(base, tie_word_embeddings=False), "value"


def _check(label: str, chunks, rules) -> list[str]:
    """Problems (one line each) between the table's rows and the model's parameters."""
    from rl_megatron.checkpoint.hf_loader import iter_rule_params, unwrap

    problems, seen = [], set()
    for chunk in chunks:
        for rule, layer, param in iter_rule_params(unwrap(chunk), rules):
            seen.add(rule.megatron)
            marked = bool(getattr(param, "tensor_model_parallel", False))
            dim = param.partition_dim if marked else None
            if dim != rule.tp_dim:
                problems.append(
                    f"{label}: '{rule.megatron.format(layer=layer)}' has partition_dim "
                    f"{dim if marked else 'none (replicated)'}, the table says {rule.tp_dim}"
                )
    tied_at_pp1 = {"output_layer.weight"} if "tied" in label else set()
    missing = {r.megatron for r in rules} - seen - tied_at_pp1
    problems += [f"{label}: row '{name}' has no parameter in the model" for name in missing]
    return problems


def _body(rank: int, world_size: int) -> None:
    import torch
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from rl_megatron.checkpoint import hf_mapping as hm
    from rl_megatron.models.builders import build_gpt_chunks, mark_tensor_parallel_weights
    from rl_megatron.models.hf_config import parse_hf_config

    ps.initialize_model_parallel(TP, 1, order=MEGATRON_RANK_ORDER)
    model_parallel_cuda_manual_seed(0)
    problems = []
    for label, cfg, head in _variants():
        info = parse_hf_config(cfg)
        rules = hm.rules_for(info, head)
        for init in (True, False):
            chunks = build_gpt_chunks(
                info,
                ParallelLayout.from_megatron(),
                dtype=torch.float32,
                value_head=head == "value",
                perform_initialization=init,
            )
            if not init:
                mark_tensor_parallel_weights(chunks)
            problems += _check(f"{label} ({'init' if init else 'for loading'})", chunks, rules)
    for label, cfg, _ in _variants():
        # megatron-core trains an MoE layer at tp > 1 only with sequence parallelism, which
        # the local spec's torch norms refuse: no MoE training step at TP=2 without TE.
        if label.endswith("/lm") and not parse_hf_config(cfg).is_moe:
            problems += _replicated_grad_problems(label, parse_hf_config(cfg))
    assert not problems, f"rank {rank}:\n" + "\n".join(problems)


def _replicated_grad_problems(label: str, info) -> list[str]:
    """Rows with tp_dim None whose gradient differs between the TP ranks after one step."""
    import torch
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )

    from rl_megatron.checkpoint import hf_mapping as hm
    from rl_megatron.checkpoint.hf_loader import iter_rule_params
    from rl_megatron.models.builders import build_gpt_chunks

    (chunk,) = build_gpt_chunks(info, ParallelLayout.from_megatron(), dtype=torch.float32)
    model = DistributedDataParallel(chunk.config, DistributedDataParallelConfig(), chunk)
    ids = torch.arange(1, 9).view(1, 8)
    # Each rank's share of a loss over its vocabulary shard; the output layer's backward
    # sums the hidden-state gradients over TP, as for the real vocab-parallel losses.
    model(ids, torch.arange(8).view(1, 8), None).pow(2).mean().backward()
    finalize_model_grads([model])
    group, problems = ps.get_tensor_model_parallel_group(), []
    for rule, layer, param in iter_rule_params(chunk, hm.rules_for(info, "lm")):
        if rule.tp_dim is not None:
            continue
        parts = [torch.empty_like(param.main_grad) for _ in range(TP)]
        torch.distributed.all_gather(parts, param.main_grad.contiguous(), group=group)
        if not torch.equal(parts[0], parts[1]) or not parts[0].abs().sum() > 0:
            problems.append(
                f"{label}: replicated '{rule.megatron.format(layer=layer)}' ends the backward "
                "with a different (or zero) gradient on each TP rank"
            )
    return problems


def test_every_family_table_matches_partition_dim():
    run_on_ranks(_body, world_size=TP)
