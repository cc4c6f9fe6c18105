"""The multi-turn demo's task, chat template and environment (data.synthetic_task: key_lookup)."""

from __future__ import annotations

import pytest

from rl_megatron.data.synthetic import (
    EOS_ID,
    ROLE_IDS,
    CharTokenizer,
    key_value,
    synthetic_dataset,
)
from rl_megatron.environments.key_lookup import CLEAN_ANSWER_CREDIT, KeyLookup
from rl_megatron.environments.loader import load_environment
from rl_megatron.rollout.trajectory import ChatIncrements


def test_records_carry_the_key_and_its_hidden_value():
    data = synthetic_dataset("key_lookup", 50, seed=3)
    again = synthetic_dataset("key_lookup", 50, seed=3)
    assert [data[i] for i in range(50)] == [again[i] for i in range(50)]
    values = set()
    for i in range(50):
        r = data[i]
        assert r["prompt"] == r["key"] and len(r["key"]) == 2 and r["key"].isalpha()
        assert r["answer"] == key_value(r["key"]) and len(r["answer"]) == 1
        values.add(r["answer"])
    assert len(values) >= 5  # the value is not guessable from one constant


def test_char_template_renders_as_increments():
    tok = CharTokenizer()
    chat = tok.chat_tokenizer
    inc = ChatIncrements(chat)
    assert inc.stop_token_ids == {EOS_ID} and inc.tail == []
    u, a, t = ROLE_IDS["user"], ROLE_IDS["assistant"], ROLE_IDS["tool"]
    assert inc.prompt([{"role": "user", "content": "kq"}]) == [u, *tok.encode("kq"), EOS_ID, a]
    assert inc.increment([{"role": "tool", "content": "7"}]) == [t, *tok.encode("7"), EOS_ID, a]
    # Prompt + sampled turn (its EOS kept) + increment == the whole conversation rendered.
    messages = [{"role": "user", "content": "kq"}]
    turn = tok.encode("?") + [EOS_ID]
    ids = inc.prompt(messages) + turn + inc.tail + inc.increment([{"role": "tool", "content": "7"}])
    full = messages + [
        {"role": "assistant", "content": "?"},
        {"role": "tool", "content": "7"},
    ]
    assert ids == chat.encode(chat.apply_chat_template(full, add_generation_prompt=True))
    assert inc.turn_text(turn) == "?"
    assert chat.decode([u, *tok.encode("ab"), EOS_ID]) == "<user>ab<eos>"
    # Rollout records decode with the trainer's tokenizer: the markers read as their names
    # there, and stay unknown characters where special tokens are skipped (rewards).
    assert tok.decode([t, *tok.encode("7"), EOS_ID, a], skip_special_tokens=False) == (
        "<tool>7<eos><assistant>"
    )
    assert tok.decode([t, *tok.encode("7"), EOS_ID]) == "\ufffd7"
    with pytest.raises(ValueError, match="no role 'system'"):
        chat.apply_chat_template([{"role": "system", "content": "x"}])


def test_the_value_comes_only_through_the_tool():
    env = load_environment("key_lookup")()
    assert isinstance(env, KeyLookup)
    assert env.start({"prompt": "kq", "key": "kq", "answer": "7"}) == [
        {"role": "user", "content": "kq"}
    ]
    guess = env.step("a3b7")  # a digit: a direct answer, its first digit (3, wrong)
    assert guess.done and guess.reward == pytest.approx(CLEAN_ANSWER_CREDIT)
    assert guess.metrics == {"tool_calls": 0.0, "answers_citing_tool": 0.0, "answers_right": 0.0}
    lucky = KeyLookup()
    lucky.start({"prompt": "kq", "answer": "7"})
    assert lucky.step("7").reward == 1.0  # a right guess counts, one time in ten

    blind = KeyLookup()
    blind.start({"prompt": "kq", "answer": "7"})
    cited = blind.step("=")  # cites a lookup that never happened: wrong
    assert cited.done and cited.reward == pytest.approx(CLEAN_ANSWER_CREDIT)
    assert cited.metrics["answers_citing_tool"] == 0.0

    env = KeyLookup()
    env.start({"prompt": "kq", "answer": "7"})
    call = env.step("ab")  # neither digit nor "=": a lookup
    assert not call.done and call.reward == 0.0
    assert call.messages == [{"role": "tool", "content": "7"}]
    assert call.metrics == {"tool_calls": 1.0}
    answer = env.step("x=")
    assert answer.done and answer.reward == 1.0
    assert answer.metrics == {"tool_calls": 0.0, "answers_citing_tool": 1.0, "answers_right": 1.0}
    again = KeyLookup()
    again.start({"prompt": "kq", "answer": "7"})
    again.step("ab")
    empty = again.step("cd")  # a second lookup is an empty answer
    assert empty.done and empty.reward == pytest.approx(CLEAN_ANSWER_CREDIT)
    other = KeyLookup()
    other.start({"prompt": "zz", "answer": "2"})
    other.step("?")
    assert other.step("7").reward == pytest.approx(CLEAN_ANSWER_CREDIT)  # the tool said 2
