"""The reward-model role: a sequence's score is the HF classifier's output at its last token.

2 ranks, TP=2: `MegatronRole(..., output_at="token")` over a tiny
`LlamaForSequenceClassification`, read at each row's last response token by
`experience.sequence_scores_at_last_token`, equals the HF model's score head applied to
its own hidden state at that token (fp32, within 1e-4), for left-padded prompts and
right-padded responses of different lengths.
"""

from __future__ import annotations

import torch

from rl_megatron.parallel import MEGATRON_RANK_ORDER, ParallelLayout
from tests.spawn import run_on_ranks

V, B, P, R = 100, 4, 5, 4
PROMPT_LENS, RESPONSE_LENS = [5, 2, 4, 3], [4, 1, 3, 2]


def _batch() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    prompts = torch.zeros(B, P, dtype=torch.long)
    responses = torch.zeros(B, R, dtype=torch.long)
    for i, (p, r) in enumerate(zip(PROMPT_LENS, RESPONSE_LENS)):
        prompts[i, P - p :] = torch.randint(1, V, (p,), generator=gen)
        responses[i, :r] = torch.randint(1, V, (r,), generator=gen)
    mask = torch.cat([(prompts != 0).long(), (responses != 0).long()], dim=1)
    return {
        "prompts": prompts,
        "responses": responses,
        "attention_mask": mask,
        "position_ids": (mask.cumsum(-1) - 1).clamp(min=0),
        "response_mask": (responses != 0).long(),
    }


def _make(root) -> None:
    from transformers import LlamaConfig, LlamaForSequenceClassification

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=V,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_labels=1,
        pad_token_id=0,
    )
    model = LlamaForSequenceClassification(cfg).eval()
    with torch.no_grad():
        model.score.weight.normal_(0, 1.0)  # a head that separates sequences
    model.save_pretrained(root / "rm", safe_serialization=True)
    batch = _batch()
    ids = torch.cat([batch["prompts"], batch["responses"]], dim=1)
    with torch.no_grad():
        hidden = model.model(
            ids, attention_mask=batch["attention_mask"], position_ids=batch["position_ids"]
        ).last_hidden_state
        per_token = model.score(hidden)[..., 0]
    last = torch.tensor([P + r - 1 for r in RESPONSE_LENS])
    torch.save({"batch": batch, "want": per_token[torch.arange(B), last]}, root / "ref.pt")


def _body(rank: int, world_size: int, root) -> None:
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from rl_megatron.checkpoint.hf_builders import build_reward_model
    from rl_megatron.trainer.experience import sequence_scores_at_last_token
    from rl_megatron.trainer.roles import MegatronRole

    ps.initialize_model_parallel(2, 1, order=MEGATRON_RANK_ORDER)
    model_parallel_cuda_manual_seed(0)
    ref = torch.load(root / "ref.pt")
    chunks = build_reward_model(root / "rm", ParallelLayout.from_megatron(), dtype=torch.float32)
    role = MegatronRole(chunks, micro_batch_size=3, output_at="token")
    values = role.forward_only(ref["batch"])["values"]
    got = sequence_scores_at_last_token(values, ref["batch"]["response_mask"])
    err = (got - ref["want"]).abs().max().item()
    assert err < 1e-4, f"reward model scores {got.tolist()} vs HF {ref['want'].tolist()}"
    assert ref["want"].std() > 0.1  # the scores differ between rows: a real comparison


def test_reward_model_scores_at_the_last_token(tmp_path):
    _make(tmp_path)
    run_on_ranks(_body, world_size=2, root=tmp_path)
