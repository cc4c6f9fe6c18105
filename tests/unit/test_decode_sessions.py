"""The Megatron engine keeps training's decode session through an evaluation.

A decode session (KV cache, step buffers and, on a GPU, one CUDA graph per position) is
costly to rebuild (~7 s of graph capture on an H200), so the engine keeps the
`MAX_SESSIONS` (2) most recently used ones. On one CPU rank with a tiny random Llama
(graphs cannot run on a CPU; the cache logic is the same): training's shape, then
evaluation's, then training's again decodes in the very session object of the first call
(no `DecodeSession` built) with bitwise the same tokens and log-probs; a third shape evicts
the least recently used session, which is then freed (no reference left) and no longer
counted in `session_bytes`; a batch narrower than a kept session of its rows decodes in it
(left-padded), with the tokens a fresh engine gives.
"""

from __future__ import annotations

import weakref

import torch

from rl_megatron.parallel import MEGATRON_RANK_ORDER, ParallelLayout
from tests.rollout_refs import tiny_llama
from tests.spawn import run_on_ranks

MAX_NEW = 8
TRAIN = [[5, 9, 3], [7] * 11, [4, 8, 15, 16, 23, 42, 6], [12]]  # n=2: 8 rows, width 16
EVAL = [[3, 3, 9], [40, 41]]  # n=1: 2 rows
OTHER = [[6, 7, 8]] * 5  # 5 rows


def _body(rank: int, world_size: int, ckpt: str) -> None:
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from rl_megatron.checkpoint.hf_builders import build_actor
    from rl_megatron.models.hf_config import load_hf_config
    from rl_megatron.rollout import decode_session
    from rl_megatron.rollout.megatron import engine as megatron_engine
    from rl_megatron.rollout.sampling import SamplingParams

    parallel_state.initialize_model_parallel(1, 1, order=MEGATRON_RANK_ORDER)
    model_parallel_cuda_manual_seed(0)
    info = load_hf_config(ckpt)
    chunks = build_actor(ckpt, ParallelLayout.from_megatron(), dtype=torch.float32)

    built = []

    class Counted(decode_session.DecodeSession):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            built.append(self.shape)

    decode_session.DecodeSession = Counted
    engine = megatron_engine.MegatronEngine(chunks, info, max_model_len=64, seed=0)
    train = SamplingParams(temperature=0.8, n=2, max_new_tokens=MAX_NEW, ignore_eos=True, seed=3)
    greedy = SamplingParams(temperature=0, max_new_tokens=MAX_NEW, ignore_eos=True)

    def run(prompts, sampling):
        batch = engine.generate(prompts, sampling)
        return batch.responses.clone(), batch.rollout_log_probs.clone()

    first = run(TRAIN, train)
    (train_shape,) = built
    train_session = engine._sessions[train_shape]
    run(EVAL, greedy)
    assert len(built) == 2
    eval_shape = built[1]
    third = run(TRAIN, train)
    assert len(built) == 2, f"a session was rebuilt: {built}"
    assert engine._sessions[train_shape] is train_session
    for a, b in zip(first, third, strict=True):
        assert torch.equal(a, b)

    # Memory: each session's KV cache (2 layers, K and V, [P + R, rows, 2 groups, 32], fp32)
    # is counted; a third shape evicts the least recently used session (evaluation's).
    kv = 2 * 2 * (16 + MAX_NEW) * 8 * 2 * 32 * 4
    assert train_session.nbytes >= kv
    evicted = weakref.ref(engine._sessions[eval_shape])
    evicted_cache = weakref.ref(engine._sessions[eval_shape].ctx.key_value_memory_dict[1][0])
    run(OTHER, greedy)
    assert list(engine._sessions) == [train_shape, built[2]]
    # Freed when evicted: by reference counting, before the new session allocated.
    assert evicted() is None and evicted_cache() is None
    assert engine.session_bytes == train_session.nbytes + engine._sessions[built[2]].nbytes

    # A batch of training's rows whose prompts need width 16 decodes in a kept session of
    # width 32 (left-padded): no session built, the tokens a fresh engine gives.
    wide = [[7] * 20, [5, 9, 3], [4, 8], [12]]
    run(wide, train)
    wide_shape = built[-1]
    assert wide_shape[1] == 32
    count = len(built)
    got = run(TRAIN, train)
    assert len(built) == count and wide_shape in engine._sessions
    assert torch.equal(got[0], first[0])
    assert (got[1] - first[1]).abs().max() < 2e-5  # summation order over more padding
    parallel_state.destroy_model_parallel()


def test_sessions_survive_evaluation(tmp_path):
    tiny_llama(0).save_pretrained(tmp_path / "ckpt", safe_serialization=True)
    run_on_ranks(_body, world_size=1, ckpt=str(tmp_path / "ckpt"))
