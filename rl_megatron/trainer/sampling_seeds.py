"""Each training replica's sampling parameters per step: the seeds a resumed run, and the
generation ranks of split placement (`split_rollouts.py`), must draw alike."""

from __future__ import annotations

from rl_megatron.config import Config
from rl_megatron.rollout.sampling import SamplingParams


def step_sampling(
    config: Config,
    eos: int | None,
    step: int,
    dp_rank: int,
    dp_size: int,
    local_batch: int,
    *,
    multi_turn: bool = False,
    evaluation: bool = False,
    round_index: int = 0,
) -> SamplingParams:
    """Training replica `dp_rank`'s sampling in `step` (round `round_index`); the
    generation ranks of split placement draw with it too (`split_rollouts.py`)."""
    r, ds = config.rollout, config.algorithm.dynamic_sampling
    n = 1 if evaluation else r.n
    # Seeds unique per (step, round, replica, prompt, sample[, turn]) and a function of
    # these only, so a resumed run draws exactly the samples the uninterrupted run drew.
    # A multi-turn trajectory draws one seed per turn (`turn_seed`).
    rounds = 1 + ds.max_extra_rounds if ds.enable and not evaluation else 1
    draw = step * rounds + round_index
    per_sample = r.multi_turn.max_turns if multi_turn else 1
    seed = config.trainer.seed + ((draw * dp_size + dp_rank) * local_batch * r.n * per_sample)
    return SamplingParams(
        temperature=r.val_temperature if evaluation else r.temperature,
        top_p=1.0 if evaluation else r.top_p,
        top_k=-1 if evaluation else r.top_k,
        max_new_tokens=r.max_response_length,
        n=n,
        seed=seed,
        prompt_overflow="reject" if r.prompt_overflow == "reject" else "truncate_left",
        max_prompt_len=r.max_prompt_length,
        # The tokenizer's EOS ends a response, whatever the checkpoint's config says.
        stop_token_ids=None if eos is None else (eos,),
    )
