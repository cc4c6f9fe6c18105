"""VllmEngine.generate_trajectories (CPU build of vLLM): turns taken as they come.

One torchrun of 2 ranks per rollout TP (tests/vllm/multi_turn_script.py): TP = 2 (one
replica: rank 0 drives, rank 1 replays its adds and steps) and TP = 1 (two replicas, each
driving half the records, gathered back). A tiny random Llama whose vocabulary is the
Qwen2.5-style test tokenizer's (tests/chat_templates.py); its turns stop at <|im_end|> or
at any of many other words (the stop ids passed to `ChatIncrements`), so a random model
still ends turns cleanly and trajectories have several.

Checks: (a) trajectories advance independently: one record's environment answers its
first turn 3 s late, and every other trajectory has run all its turns before that answer
(a lock-step rollout, where turn k + 1 waits for every turn k's observation, cannot);
(b) each sampled token's log-prob matches `transformers` on the trajectory's tokens within
the trainer's tolerance for vLLM (1e-3, tests/vllm/test_trainer_vllm.py); (c) each
trajectory's tokens are the prompt, the sampled turns, and after each turn the tail and
the increment of the environment's message, exactly.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from tests.chat_templates import make_chat_tokenizer
from tests.rollout_refs import hf_log_probs
from tests.vllm.multi_turn_script import SLOW_S, tool_message
from tests.vllm.torchrun_script import run_script

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

SCRIPT = Path(__file__).with_name("multi_turn_script.py")
MAX_TURNS, MAX_TURN_TOKENS, MAX_MODEL_LEN, N, TEMPERATURE = 3, 12, 256, 2, 1.0
QUESTIONS = ["what is the key", "look up x", "add 1 2", "what is y"]
SLOW_RECORD = 1
LOGPROB_TOL = 1e-3  # vLLM vs the trainer's recomputation (test_trainer_vllm.py)
RUN_TIMEOUT_S = 480


def tiny_model(vocab: int) -> LlamaForCausalLM:
    """tests/rollout_refs.tiny_llama's shape, with the test tokenizer's vocabulary."""
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,  # the vLLM CPU kernels' minimum
        vocab_size=vocab,
        max_position_embeddings=MAX_MODEL_LEN,
        initializer_range=0.1,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config).eval()
    model.generation_config.eos_token_id = None
    return model


@pytest.fixture(scope="module")
def ref(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("vllm_multi_turn")
    tokenizer = make_chat_tokenizer("qwen2.5")
    tokenizer.save_pretrained(root / "tokenizer")
    model = tiny_model(len(tokenizer))
    model.save_pretrained(root / "ckpt", safe_serialization=True)
    words = [str(i) for i in range(21)] + [".", ",", "?", "!"]
    stop_ids = [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    stop_ids += [tokenizer.convert_tokens_to_ids(w) for w in words]
    records = [{"question": q, "slow": i == SLOW_RECORD} for i, q in enumerate(QUESTIONS)]
    spec = {
        "ckpt": str(root / "ckpt"),
        "tokenizer": str(root / "tokenizer"),
        "stop_token_ids": stop_ids,
        "records": records,
        "n": N,
        "max_turns": MAX_TURNS,
        "max_turn_tokens": MAX_TURN_TOKENS,
        "max_model_len": MAX_MODEL_LEN,
        "temperature": TEMPERATURE,
    }
    return {"root": root, "spec": spec, "model": model, "tokenizer": tokenizer}


@pytest.fixture(scope="module", params=[2, 1], ids=["tp2", "tp1"])
def run(request, ref) -> list[dict]:
    tp = request.param
    out = ref["root"] / f"out_tp{tp}"
    out.mkdir()
    spec_path = ref["root"] / f"spec_tp{tp}.json"
    spec_path.write_text(json.dumps({**ref["spec"], "tp": tp}))
    return run_script(SCRIPT, spec_path, out, RUN_TIMEOUT_S)


def test_every_rank_returns_every_trajectory_in_record_order(run):
    first = run[0]["trajectories"]
    assert [(t["group"], t["sample"]) for t in first] == [
        (i, j) for i in range(len(QUESTIONS)) for j in range(N)
    ]
    assert run[1]["trajectories"] == first
    assert all(t["error"] is None for t in first)
    # Several turns each, or the other checks would be weak.
    turns = [len(t["turns"]) for t in first]
    assert sum(turns) >= 2 * len(first), turns
    # The metrics of every trajectory (with TP = 1, the two replicas' combined).
    metrics = run[0]["metrics"]
    assert run[1]["metrics"] == metrics
    assert metrics["multi_turn/turns_mean"] == pytest.approx(sum(turns) / len(turns))
    assert metrics["multi_turn/turns_max"] == max(turns)
    lengths = [len(t["token_ids"]) for t in first]
    assert metrics["multi_turn/length_max"] == max(lengths)
    assert metrics["multi_turn/length_mean"] == pytest.approx(sum(lengths) / len(lengths))
    reasons = [t["finish_reason"] for t in first]
    for reason in ("max_turns", "turn_length", "context_length"):
        assert metrics[f"multi_turn/finish_{reason}"] == reasons.count(reason)
    assert metrics["env/at_1"] == pytest.approx(sum(t["metrics"].get("at_1", 0) for t in first))


def test_a_slow_environment_holds_only_its_own_trajectory(run):
    trajs = run[0]["trajectories"]
    slow = [t for t in trajs if t["group"] == SLOW_RECORD]
    fast = [t for t in trajs if t["group"] != SLOW_RECORD]
    # The slow record's first answer came SLOW_S after the start at the earliest.
    slow_first = min(t["metrics"]["at_1"] for t in slow)
    assert slow_first >= run[0]["started"] + SLOW_S
    # Every other trajectory had all its answers (its last turn's included) before it.
    last = [max(t["metrics"].values(), default=0.0) for t in fast]
    assert max(last) < slow_first, (last, slow_first)
    assert sum(len(t["turns"]) >= 2 for t in fast) >= len(fast) // 2


def test_tokens_are_prompt_turns_and_increments(run, ref):
    from rl_megatron.rollout.trajectory import ChatIncrements

    increments = ChatIncrements(ref["tokenizer"], stop_token_ids=ref["spec"]["stop_token_ids"])
    for t in run[0]["trajectories"]:
        ids = t["token_ids"]
        expected = increments.prompt([{"role": "user", "content": QUESTIONS[t["group"]]}])
        assert t["prompt_length"] == len(expected)
        mask = [0] * len(expected)
        for k, (start, end) in enumerate(t["turns"]):
            assert start == len(expected)
            expected += ids[start:end]
            mask += [1] * (end - start)
            if k < len(t["observations"]):
                added = increments.tail + increments.increment([tool_message(k + 1)])
                assert t["observations"][k] == [len(expected), len(expected) + len(added)]
                expected += added
                mask += [0] * len(added)
        assert ids == expected
        assert t["loss_mask"] == mask
        # A turn that did not end at a stop token ended its trajectory.
        stops = set(ref["spec"]["stop_token_ids"])
        for _start, end in t["turns"][:-1]:
            assert ids[end - 1] in stops
        assert len(t["turns"]) <= MAX_TURNS


def test_sampled_log_probs_match_transformers(run, ref):
    worst = 0.0
    for t in run[0]["trajectories"]:
        ids, lp = t["token_ids"], t["logprobs"]
        p = t["prompt_length"]
        recomputed = hf_log_probs(ref["model"], ids[:p], ids[p:], TEMPERATURE)
        for i, mask in enumerate(t["loss_mask"][p:]):
            if mask:
                worst = max(worst, abs(lp[p + i] - recomputed[i]))
            else:
                assert lp[p + i] == 0.0
    assert worst < LOGPROB_TOL
