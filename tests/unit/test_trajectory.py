"""rollout/trajectory.py: the chat template's prompt, tail and increments, measured once per
tokenizer, for the Llama-3, Qwen2.5 and Qwen3 formats; the trajectory's aligned arrays."""

from __future__ import annotations

import pytest

from rl_megatron.rollout.trajectory import ChatIncrements, IncrementError, Trajectory
from tests.chat_templates import QWEN25, make_chat_tokenizer

TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {}}}]
TOOL_RESULT = [{"role": "tool", "content": "result 7"}]

# Hand-written from each format: the tail after the stop token, and a tool result's
# increment up to the next generation prompt.
EXPECTED = {
    "llama3": (
        "",
        "<|start_header_id|>ipython<|end_header_id|>\n\nresult 7<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n",
    ),
    "qwen2.5": (
        "\n",
        "<|im_start|>user\n<tool_response>\nresult 7\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n",
    ),
    "qwen3": (
        "\n",
        "<|im_start|>user\n<tool_response>\nresult 7\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n",
    ),
}


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("family", ["llama3", "qwen2.5", "qwen3"])
def test_tail_and_increment_match_the_format(family):
    tokenizer = make_chat_tokenizer(family)
    increments = ChatIncrements(tokenizer)
    tail, increment = EXPECTED[family]
    assert increments.tail == encode(tokenizer, tail)
    assert increments.increment(TOOL_RESULT) == encode(tokenizer, increment)
    assert tokenizer.unk_token_id not in increments.increment(TOOL_RESULT)


def test_consecutive_tool_results_are_one_increment():
    tokenizer = make_chat_tokenizer("qwen2.5")
    two = [{"role": "tool", "content": "result 7"}, {"role": "tool", "content": "result 8"}]
    assert ChatIncrements(tokenizer).increment(two) == encode(
        tokenizer,
        "<|im_start|>user\n<tool_response>\nresult 7\n</tool_response>\n<tool_response>\n"
        "result 8\n</tool_response><|im_end|>\n<|im_start|>assistant\n",
    )


def test_prompt_renders_the_tools_and_the_generation_prompt():
    tokenizer = make_chat_tokenizer("llama3")
    prompt = ChatIncrements(tokenizer, tools=TOOLS).prompt([{"role": "user", "content": "add 2"}])
    assert prompt == encode(
        tokenizer,
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\ntools : lookup "
        "<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nadd 2<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n",
    )


def test_qwen3_keeps_the_sampled_thinking_that_a_rerendered_history_drops():
    """Token in, token out: after a user's reply, Qwen3's template renders the earlier
    turn without its <think> block; the trajectory keeps what was sampled."""
    tokenizer = make_chat_tokenizer("qwen3")
    increments = ChatIncrements(tokenizer)
    question = [{"role": "user", "content": "what is the key"}]
    first = encode(tokenizer, "<think>\nhmm\n</think>\n\nmaybe 7<|im_end|>")
    reply = [{"role": "user", "content": "again please"}]
    second = encode(tokenizer, "answer 7<|im_end|>")

    traj = Trajectory(group=0, sample=0)
    traj.set_prompt(increments.prompt(question))
    traj.add_turn(first, [-0.5] * len(first))
    traj.add_observation(increments.tail + increments.increment(reply))
    traj.add_turn(second, [-0.25] * len(second))

    sampled_text = (
        "<|im_start|>system\nyou are a helper .<|im_end|>\n<|im_start|>user\nwhat is the key"
        "<|im_end|>\n<|im_start|>assistant\n<think>\nhmm\n</think>\n\nmaybe 7<|im_end|>\n"
        "<|im_start|>user\nagain please<|im_end|>\n<|im_start|>assistant\nanswer 7<|im_end|>"
    )
    assert traj.token_ids == encode(tokenizer, sampled_text)
    # What the engine would be given for turn 2 if the history were rendered again:
    history = [*question, {"role": "assistant", "content": increments.turn_text(first)}, *reply]
    rerendered = increments.prompt(history)
    given = traj.token_ids[: traj.turns[1][0]]  # what the trajectory gives it
    think = tokenizer.convert_tokens_to_ids("<think>")
    assert think in given and think not in rerendered and len(rerendered) < len(given)
    # The mask is 1 exactly on the sampled tokens; log-probs sit on them, 0 elsewhere.
    on = [i for i, m in enumerate(traj.loss_mask) if m]
    spans = [range(s, e) for s, e in traj.turns]
    assert on == [i for span in spans for i in span]
    assert [traj.token_ids[i] for i in on] == first + second
    assert [traj.logprobs[i] for i in on] == [-0.5] * len(first) + [-0.25] * len(second)
    assert all(traj.logprobs[i] == 0.0 for i, m in enumerate(traj.loss_mask) if not m)
    assert len(traj.token_ids) == len(traj.loss_mask) == len(traj.logprobs)


def test_turn_text_leaves_the_stop_token_out():
    tokenizer = make_chat_tokenizer("qwen2.5")
    ids = encode(tokenizer, "call lookup<|im_end|>")
    assert ChatIncrements(tokenizer).turn_text(ids) == "call lookup"


def test_turn_text_keeps_a_last_token_that_is_not_a_stop_and_the_special_tokens():
    # A turn cut by its token budget ends without the stop token: all of it is the text.
    # Special tokens the policy wrote are part of what it said (the environment sees them).
    tokenizer = make_chat_tokenizer("qwen2.5")
    increments = ChatIncrements(tokenizer)
    assert increments.turn_text(encode(tokenizer, "call lookup")) == "call lookup"
    ids = encode(tokenizer, "call<|im_start|>lookup<|im_end|>")
    assert increments.turn_text(ids) == "call <|im_start|> lookup"  # word-level: spaces
    assert increments.turn_text([]) == ""


def test_the_template_writes_the_only_bos():
    # Llama-3's tokenizer adds <|begin_of_text|> on encode and its template writes one too:
    # the rendered text must be encoded without extras, or every prompt starts with two.
    tokenizer = make_chat_tokenizer("llama3")
    assert tokenizer.encode("call")[0] == tokenizer.bos_token_id  # the fixture adds it
    increments = ChatIncrements(tokenizer)
    prompt = increments.prompt([{"role": "user", "content": "call lookup"}])
    assert prompt.count(tokenizer.bos_token_id) == 1 and prompt[0] == tokenizer.bos_token_id
    assert tokenizer.bos_token_id not in increments.increment(TOOL_RESULT)


def test_a_template_without_the_stop_token_after_the_answer_is_refused():
    tokenizer = make_chat_tokenizer("qwen2.5")
    tokenizer.chat_template = QWEN25.replace("m.content + '<|im_end|>\n'", "m.content + '\n'")
    assert tokenizer.chat_template != QWEN25
    with pytest.raises(IncrementError, match=r"^chat template: no stop token \[\d+\] after"):
        ChatIncrements(tokenizer)


def test_a_generation_prompt_that_is_not_a_prefix_is_refused():
    tokenizer = make_chat_tokenizer("qwen2.5")
    # The generation prompt says "assistant\n\n", the rendered answer "assistant\n".
    tokenizer.chat_template = QWEN25.replace(
        "'<|im_start|>assistant\n' -}}{%- endif -%}", "'<|im_start|>assistant\n\n' -}}{%- endif -%}"
    )
    assert tokenizer.chat_template != QWEN25
    with pytest.raises(IncrementError, match="is not a prefix of the conversation"):
        ChatIncrements(tokenizer)


def test_logprobs_must_match_the_sampled_tokens():
    traj = Trajectory(group=0, sample=0)
    with pytest.raises(ValueError, match="3 sampled tokens but 2 log-probs"):
        traj.add_turn([1, 2, 3], [0.0, 0.0])
