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

Tolerance: none; attributes and names are compared exactly.
"""

from __future__ import annotations

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


def _variants():
    """(label, HF config, head) for every family: untied LM, tied LM, value head."""
    from rl_megatron.models.families import FAMILIES

    for model_type in FAMILIES:
        base = dict(_BASE, model_type=model_type)
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

    ps.initialize_model_parallel(TP, 1)
    model_parallel_cuda_manual_seed(0)
    problems = []
    for label, cfg, head in _variants():
        info = parse_hf_config(cfg)
        rules = hm.rules_for(info, head)
        for init in (True, False):
            chunks = build_gpt_chunks(
                info,
                tp=TP,
                pp=1,
                dtype=torch.float32,
                value_head=head == "value",
                perform_initialization=init,
            )
            if not init:
                mark_tensor_parallel_weights(chunks)
            problems += _check(f"{label} ({'init' if init else 'for loading'})", chunks, rules)
    assert not problems, f"rank {rank}:\n" + "\n".join(problems)


def test_every_family_table_matches_partition_dim():
    run_on_ranks(_body, world_size=TP)
