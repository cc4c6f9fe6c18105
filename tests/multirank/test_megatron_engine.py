"""MegatronEngine (KV-cache generation on the actor's GPTModel) against `transformers`.

One spawn of 2 gloo ranks runs every case twice: at TP=2, then (parallel state rebuilt)
at TP=1 with DP=2, each rank its own engine. Tiny random Llama built in the test; each rank
asserts against expectations computed with `transformers` in this process.

Tolerances:
* greedy tokens: exact; the reference's smallest top-1 lead is checked to exceed 1e-4
  (fp32 noise between implementations and TP splits is ~1e-6).
* engine vs recomputed log-probs (`logprob_parity`), and seeded samples' log-probs
  between differently split calls: 2e-5 absolute. Both are fp32 forwards
  of the same modules; KV-cache decoding and one full pass differ only in summation order
  and in RoPE's absolute offsets for left-padded rows.

In cuda mode (tests/spawn.py) every case above runs on the ranks' GPUs in fp32 (TF32 off),
with the same tolerances: greedy tokens must match exactly, which bf16 cannot promise
against an fp32 reference. Then a bf16 engine samples again and its log-probs are checked
(`_bf16_logprob_parity`) against a bf16 and an fp32 Megatron forward of the same tokens,
within LOGPROB_TOL_BF16 = 0.15 nats: bf16 keeps 8 significant bits, and a forward of this
2-layer model (logits up to |z| ≈ 3.3) rounds a dozen tensors in sequence, leaving logit
errors of a few bf16 roundings of |z|, 4 · 2^-8 · 3.3 ≈ 0.05 (a bf16 CPU forward of the
same model measures 0.033); a log-prob z_i/T − logsumexp(z/T) moves by at most twice that
over T = 0.7, 0.15. A wrong position, token or temperature moves log-probs by O(1) nats.
"""

from __future__ import annotations

import pytest
import torch

from rl_megatron.parallel import MEGATRON_RANK_ORDER, ParallelLayout
from tests.spawn import ON_GPU, run_on_ranks

MAX_MODEL_LEN, MAX_NEW, TEMPERATURE = 128, 12, 0.7
PROMPT_LENGTHS = (1, 5, 17, 45, 70)
LONG_PROMPT_LEN = 130  # > MAX_MODEL_LEN - MAX_NEW
LOGPROB_TOL, MIN_GAP = 2e-5, 1e-4
LOGPROB_TOL_BF16 = 0.15


def _body(rank: int, world_size: int, ref: dict) -> None:
    from megatron.core import parallel_state

    for tp in (2, 1):
        parallel_state.initialize_model_parallel(tp, 1, order=MEGATRON_RANK_ORDER)
        _cases(tp, ref)
        if ON_GPU:
            _bf16_logprob_parity(ref)
        parallel_state.destroy_model_parallel()


def _bf16_logprob_parity(ref: dict) -> None:
    """A bf16 engine's sampled log-probs against bf16 and fp32 recomputation (cuda mode)."""
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from rl_megatron.checkpoint.hf_builders import build_actor
    from rl_megatron.models.hf_config import load_hf_config
    from rl_megatron.rollout.megatron.engine import MegatronEngine
    from rl_megatron.rollout.sampling import SamplingParams

    model_parallel_cuda_manual_seed(0)
    info = load_hf_config(ref["ckpt_a"])
    bf16 = build_actor(ref["ckpt_a"], ParallelLayout.from_megatron(), dtype=torch.bfloat16)
    engine = MegatronEngine(bf16, info, eos_token_ids=[2], max_model_len=MAX_MODEL_LEN, seed=0)
    sampled = SamplingParams(temperature=TEMPERATURE, n=3, max_new_tokens=MAX_NEW, seed=11)
    batch = engine.generate(ref["prompts"], sampled)
    fp32 = build_actor(ref["ckpt_a"], ParallelLayout.from_megatron(), dtype=torch.float32)
    for name, chunks in (("bf16", bf16), ("fp32", fp32)):
        mismatch = _logprob_gap(chunks, batch, info)
        assert mismatch["rollout/logprob_diff_max"] < LOGPROB_TOL_BF16, (name, mismatch)


def _logprob_gap(chunks, batch, info) -> dict:
    """The engine's sampled log-probs against a forward of `chunks` on the same tokens."""
    from megatron.core import parallel_state

    from rl_megatron.rollout.logprob_parity import log_prob_mismatch, recompute_log_probs

    recomputed = recompute_log_probs(
        chunks,
        batch,
        tp_group=parallel_state.get_tensor_model_parallel_group(),
        temperature=TEMPERATURE,
        vocab_size=info.vocab_size,
    )
    return log_prob_mismatch(batch.rollout_log_probs, recomputed, batch.response_mask)


def _cases(tp: int, ref: dict) -> None:
    from dataclasses import replace

    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from safetensors.torch import load_file

    from rl_megatron.checkpoint.hf_builders import build_actor
    from rl_megatron.models.hf_config import load_hf_config
    from rl_megatron.rollout.megatron.engine import MegatronEngine
    from rl_megatron.rollout.sampling import SamplingParams

    model_parallel_cuda_manual_seed(0)
    info = load_hf_config(ref["ckpt_a"])
    chunks = build_actor(ref["ckpt_a"], ParallelLayout.from_megatron(), dtype=torch.float32)
    engine = MegatronEngine(
        chunks, info, eos_token_ids=[2], max_model_len=MAX_MODEL_LEN, seed=0, max_batch_size=4
    )
    prompts = ref["prompts"]
    greedy = SamplingParams(temperature=0, max_new_tokens=MAX_NEW, ignore_eos=True)

    def responses(batch):
        batch.validate()
        return [batch.row_tokens(i)[1] for i in range(len(batch))]

    def row_log_probs(batch):
        lengths = batch.response_lengths.tolist()
        return [batch.rollout_log_probs[i, :n] for i, n in enumerate(lengths)]

    # Greedy parity; max_batch_size=4 also splits the 5 prompts into two decode batches.
    batch = engine.generate(prompts, greedy)
    assert responses(batch) == ref["greedy_a"]
    assert batch.finish_reasons == ["length"] * 5 and batch.weight_version == 0

    # EOS in the middle of the batch.
    batch = engine.generate(
        prompts, SamplingParams(temperature=0, max_new_tokens=MAX_NEW, stop_token_ids=[ref["eos"]])
    )
    assert responses(batch) == ref["eos_tokens"]
    assert {"stop", "length"} <= set(batch.finish_reasons)

    # n > 1 sampling; the engine's log-probs agree with a Megatron forward.
    sampled = SamplingParams(temperature=TEMPERATURE, n=3, max_new_tokens=8, seed=11)
    batch = engine.generate(prompts[:3], sampled)
    assert batch.group_index.tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    for g in range(3):
        group = {tuple(r) for r, i in zip(responses(batch), batch.group_index) if i == g}
        assert len(group) > 1, f"prompt {g}: all 3 samples identical"
    assert responses(engine.generate(prompts[:3], sampled)) == responses(batch)
    # Split-independence: the same rows drawn in other calls and other decode batches
    # (max_batch_size 2, other left-padding widths) are the same samples. Prompt i of a call
    # seeded s is prompt i + lo of a call seeded s - lo·n. Log-probs: LOGPROB_TOL, as below.
    small = MegatronEngine(
        chunks, info, eos_token_ids=[2], max_model_len=MAX_MODEL_LEN, seed=5, max_batch_size=2
    )
    pieces = [
        small.generate(prompts[lo:hi], replace(sampled, seed=sampled.seed + lo * sampled.n))
        for lo, hi in ((0, 1), (1, 3))
    ]
    assert [r for piece in pieces for r in responses(piece)] == responses(batch)
    split_lps = [lp for piece in pieces for lp in row_log_probs(piece)]
    for got, want in zip(split_lps, row_log_probs(batch), strict=True):
        assert (got - want).abs().max() < LOGPROB_TOL
    # Per-prompt seeds (multi-turn waves): prompts in another order, each with the seed it
    # had in the call above, are the same samples; a wrong count is refused.
    order = [2, 0, 1]
    reordered = small.generate(
        [prompts[i] for i in order],
        replace(sampled, seed=None, prompt_seeds=[sampled.prompt_seed(i) for i in order]),
    )
    by_prompt = {i: responses(batch)[3 * i : 3 * i + 3] for i in range(3)}
    assert responses(reordered) == [r for i in order for r in by_prompt[i]]
    with pytest.raises(ValueError, match="prompt_seeds holds 2 seeds for 3 prompts"):
        small.generate(prompts[:3], replace(sampled, prompt_seeds=[1, 2]))
    # Per-prompt caps on new tokens (benchmarks/async_ab.py's length sampler): a capped row
    # is the uncapped row's first tokens (same seeds, same log-probs within LOGPROB_TOL)
    # and ends exactly at its cap with "length", while the other rows of its decode batch
    # go on; a cap above max_new_tokens changes nothing.
    free = replace(sampled, ignore_eos=True)
    caps = [3, 20, 5]
    capped = small.generate(prompts[:3], replace(free, prompt_max_new_tokens=caps))
    uncapped = small.generate(prompts[:3], free)
    cut = [min(caps[g], free.max_new_tokens) for g in capped.group_index.tolist()]
    assert cut == [3] * 3 + [8] * 3 + [5] * 3
    assert responses(capped) == [r[:n] for r, n in zip(responses(uncapped), cut)]
    assert capped.response_lengths.tolist() == cut
    assert capped.finish_reasons == ["length"] * 9
    for got, want, n in zip(row_log_probs(capped), row_log_probs(uncapped), cut, strict=True):
        assert (got - want[:n]).abs().max() < LOGPROB_TOL
    # With a stop token: a row whose stop token is its cap-th token ends with "stop", one
    # capped a token earlier with "length", one that never stops with "length" at its cap.
    # Five prompts over max_batch_size 4: two decode batches, each with its own caps.
    eos = ref["eos"]
    ends = [i for i, e in enumerate(ref["eos_tokens"]) if e[-1] == eos]
    caps = [7] * len(prompts)
    for k, i in enumerate(ends):
        caps[i] = max(1, len(ref["eos_tokens"][i]) - k % 2)
    stopped = engine.generate(
        prompts,
        SamplingParams(
            temperature=0, max_new_tokens=MAX_NEW, stop_token_ids=[eos], prompt_max_new_tokens=caps
        ),
    )
    want = [e[:c] for e, c in zip(ref["eos_tokens"], caps)]
    assert responses(stopped) == want
    reasons = ["stop" if eos in w else "length" for w in want]
    assert stopped.finish_reasons == reasons and {"stop", "length"} <= set(reasons)

    mismatch = _logprob_gap(chunks, batch, info)
    assert mismatch["rollout/logprob_diff_max"] < LOGPROB_TOL, mismatch

    # Prompt longer than the context: rejected or truncated, counted.
    with_long = [prompts[0], ref["long_prompt"], prompts[1]]
    for policy in ("reject", "truncate_left"):
        sp = SamplingParams(
            temperature=0, max_new_tokens=MAX_NEW, ignore_eos=True, prompt_overflow=policy
        )
        batch = engine.generate(with_long, sp)
        got = responses(batch)
        assert [got[0], got[2]] == ref["greedy_a"][:2]
        if policy == "reject":
            assert batch.finish_reasons[1] == "rejected" and got[1] == []
            assert batch.metrics()["rollout/prompts_rejected"] == 1
        else:
            assert bool(batch.prompt_truncated[1]) and got[1] == ref["truncated_tokens"]
            assert batch.metrics()["rollout/prompts_truncated"] == 1

    # HF-named weights, in two buckets, land in the modules.
    sd_b = load_file(f"{ref['ckpt_b']}/model.safetensors")
    names = sorted(sd_b)
    engine.begin_weight_update(1)
    engine.load_weights({k: sd_b[k] for k in names[:5]})
    engine.load_weights({k: sd_b[k] for k in names[5:]})
    engine.finish_weight_update()
    batch = engine.generate(prompts, greedy)
    assert responses(batch) == ref["greedy_b"] and batch.weight_version == 1
    # Shared modules: a sync from them only stamps the version; other modules are refused.
    assert engine.generates_with_trainer_modules
    assert engine.sync_from(chunks, version=2) is None
    assert engine.generate(prompts[:1], greedy).weight_version == 2
    with pytest.raises(ValueError, match="other modules than the ones it generates with"):
        engine.sync_from(
            build_actor(ref["ckpt_a"], ParallelLayout.from_megatron(), dtype=torch.float32), 3
        )
    assert engine.weight_version == 2


@pytest.fixture(scope="module")
def ref(tmp_path_factory) -> dict:
    # Imported here, not at the top: spawned ranks import this module and need no HF.
    from tests.rollout_refs import hf_greedy, pick_mid_batch_eos, tiny_llama

    root = tmp_path_factory.mktemp("megatron_engine")
    models = {}
    for name, seed in (("a", 0), ("b", 1)):
        models[name] = tiny_llama(seed)
        models[name].save_pretrained(root / f"ckpt_{name}", safe_serialization=True)
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 128, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]
    long_prompt = torch.randint(3, 128, (LONG_PROMPT_LEN,), generator=g).tolist()
    out, gaps = {}, []
    for name in ("a", "b"):
        rows = [hf_greedy(models[name], p, MAX_NEW) for p in prompts]
        out[f"greedy_{name}"] = [r[0] for r in rows]
        gaps += [r[1] for r in rows]
    eos = pick_mid_batch_eos(out["greedy_a"])
    limit = MAX_MODEL_LEN - MAX_NEW
    truncated, gap = hf_greedy(models["a"], long_prompt[-limit:], MAX_NEW)
    return {
        **out,
        "ckpt_a": str(root / "ckpt_a"),
        "ckpt_b": str(root / "ckpt_b"),
        "prompts": prompts,
        "long_prompt": long_prompt,
        "eos": eos,
        "eos_tokens": [hf_greedy(models["a"], p, MAX_NEW, eos=eos)[0] for p in prompts],
        "truncated_tokens": truncated,
        "min_gap": min([*gaps, gap]),
    }


def test_reference_is_decisive(ref):
    assert ref["min_gap"] > MIN_GAP


def test_megatron_engine_matches_transformers(ref):
    run_on_ranks(_body, world_size=2, ref=ref)
