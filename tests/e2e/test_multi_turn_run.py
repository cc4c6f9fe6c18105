"""A multi-turn run end to end (Megatron engine, 4 ranks TP=2 x DP=2, the key_lookup task's
character chat template, a test environment that answers every clean turn): the records
hold exactly the tokens the template and the engine made, the mask is 0 on every
observation token, the rewards are the environment's, and the engine's log-probs agree
with the trainer's recomputed ones on the sampled tokens."""

from __future__ import annotations

import json

import pytest

from rl_megatron.data.synthetic import EOS_ID, ROLE_IDS, CharTokenizer
from tests.e2e.test_launcher import _run

AGENT = "yaml_configs/tiny_agent_cpu.yaml"
ENV = "tests/e2e/envs/echo_env.py:SeenEnv"


@pytest.mark.slow
def test_multi_turn_run_records_and_metrics(tmp_path):
    max_turns, turn_tokens = 3, 16
    result = _run(
        [
            "--config", AGENT, f"trainer.output_dir={tmp_path}", f"environment.function={ENV}",
            "trainer.total_steps=2", "trainer.val_interval=2", "checkpoint.save_interval=0",
            f"rollout.multi_turn.max_turns={max_turns}",
            f"rollout.multi_turn.max_turn_tokens={turn_tokens}", "rollout.max_response_length=48",
        ],
        torchrun_ranks=4,
        timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    run = tmp_path / "tiny_agent_cpu"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert "turns" in result.stdout and "tools" in result.stdout  # the step line
    tok = CharTokenizer()
    with_observations = 0
    for row in rows:
        records = [
            json.loads(line)
            for line in (run / "rollouts" / f"step_{row['step']:08d}.jsonl")
            .read_text()
            .splitlines()
        ]
        assert len(records) == 16 * 4
        turns_total = tools_total = 0
        for r in records:
            # The prompt: <user> key <eos> <assistant>, rendered independently here.
            key = tok.decode(r["prompt_ids"][1:3])
            assert r["prompt_ids"] == [
                ROLE_IDS["user"],
                *tok.encode(key),
                EOS_ID,
                ROLE_IDS["assistant"],
            ]
            assert r["token_ids"] == r["prompt_ids"] + r["response_ids"]
            mask, ids = r["loss_mask"], r["token_ids"]
            # Walk the tokens: turns (mask 1) end at EOS or at the turn budget; between
            # them exactly the tool message "seen k" as the template renders it (mask 0).
            pos, turn = len(r["prompt_ids"]), 0
            while pos < len(ids):
                end = pos
                while end < len(ids) and mask[end] == 1:
                    end += 1
                turn += 1
                sampled = ids[pos:end]
                assert 1 <= len(sampled) <= turn_tokens
                if end == len(ids):
                    break
                assert sampled[-1] == EOS_ID  # only a cleanly ended turn gets an answer
                expected = [
                    ROLE_IDS["tool"],
                    *tok.encode(f"seen {turn}"),
                    EOS_ID,
                    ROLE_IDS["assistant"],
                ]
                assert ids[end : end + len(expected)] == expected
                assert mask[end : end + len(expected)] == [0] * len(expected)
                pos = end + len(expected)
                with_observations += 1
            assert r["num_turns"] == turn == len(r["turns"])
            assert len(r["observations"]) == turn - 1
            # Records are for reading: the template's markers decode as their names.
            assert [o["text"] for o in r["observations"]] == [
                f"<tool>seen {k}<eos><assistant>" for k in range(1, turn)
            ]
            last_clean = ids[-1] == EOS_ID
            if r["finish_reason"] == "max_turns":
                assert turn == max_turns and last_clean
            elif r["finish_reason"] == "turn_length":
                assert not last_clean and len(r["turns"]) == turn
            else:
                assert r["finish_reason"] == "context_length", r["finish_reason"]
            # 0.25 per clean turn, and the rule is off (reward.function: null).
            clean_turns = turn - 1 + int(last_clean)
            assert r["reward"] == pytest.approx(0.25 * clean_turns) == r["env_reward"]
            turns_total += turn
            tools_total += clean_turns
            assert len(r["rollout_log_probs"]) == len(r["response_ids"])
        assert row["multi_turn/turns_mean"] == pytest.approx(turns_total / len(records))
        assert row["env/tool_calls"] == pytest.approx(tools_total)
        assert row["reward/mean"] == pytest.approx(0.25 * tools_total / len(records), abs=1e-6)
        # The engine's log-probs of the sampled tokens, against the trainer's recomputation.
        assert row["rollout/logprob_diff_max"] < 1e-3, row["rollout/logprob_diff_max"]
    assert with_observations > 0  # the seeds give some clean turns: observations were tested
    assert "val/reward_mean" in rows[-1]
