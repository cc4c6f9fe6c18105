"""The built-in tool environment: start from a record, answer tool calls, end on an answer."""

from __future__ import annotations

import json

import pytest

from rl_megatron.environments.base import Observation
from rl_megatron.environments.tool_env import ToolEnvironment


def _call(name: str, **arguments) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def test_tools_are_schemas_for_the_chat_template():
    names = [t["function"]["name"] for t in ToolEnvironment().tools]
    assert names == ["calculator", "python"]
    for tool in ToolEnvironment().tools:
        assert tool["type"] == "function" and tool["function"]["description"]
        assert tool["function"]["parameters"]["required"]


def test_start_from_a_prompt_field_with_a_system_prompt():
    env = ToolEnvironment(prompt_key="question", system_prompt="Use the tools.")
    assert env.start({"question": "2+2?", "answer": "4"}) == [
        {"role": "system", "content": "Use the tools."},
        {"role": "user", "content": "2+2?"},
    ]


def test_start_from_messages_keeps_their_system_prompt():
    messages = [{"role": "system", "content": "own"}, {"role": "user", "content": "hi"}]
    assert ToolEnvironment(system_prompt="other").start({"messages": messages}) == messages
    assert ToolEnvironment().start({"prompt": "q"}) == [{"role": "user", "content": "q"}]


def test_start_without_the_field_names_the_key():
    with pytest.raises(ValueError, match="environment.kwargs.prompt_key"):
        ToolEnvironment().start({"question": "q"})


def test_an_answer_without_a_call_ends_the_trajectory():
    assert ToolEnvironment().step("The answer is 4.") == Observation(done=True)


def test_calls_become_tool_messages_and_metrics():
    env = ToolEnvironment(python_wall_s=5, python_cpu_s=2)
    response = (
        "Computing."
        + _call("calculator", expression="6*7")
        + _call("python", code="print(sum(range(10)))")
    )
    obs = env.step(response)
    assert not obs.done and obs.reward == 0.0
    assert obs.messages == [
        {"role": "tool", "name": "calculator", "content": "42"},
        {"role": "tool", "name": "python", "content": "45"},
    ]
    assert obs.metrics == {
        "tool_calls": 2,
        "tool_errors": 0,
        "tool_timeouts": 0,
        "tool_output_truncated": 0,
    }


def test_errors_timeouts_and_cuts_are_counted_not_raised():
    env = ToolEnvironment(
        python_wall_s=2, python_cpu_s=1, python_output_bytes=100, max_calls_per_turn=5
    )
    response = (
        _call("calculator", expression="1/0")
        + "<tool_call>{not json</tool_call>"
        + _call("python", code="while True: pass")
        + _call("python", code="print('y' * 10**6)")
        + _call("python", code="raise SystemExit(3)")
        + _call("calculator", expression="1+1")  # the sixth: past max_calls_per_turn
    )
    obs = env.step(response)
    contents = [m["content"] for m in obs.messages]
    assert contents[0] == "error: division by zero"
    assert contents[1].startswith("error: tool call is not valid JSON")
    assert contents[2] == "[killed: CPU time limit of 1 s]"
    assert contents[3] == "y" * 100 + "\n[output cut at 100 bytes]"
    assert contents[4] == "[exit status 3]"
    assert contents[5] == "error: not run: at most 5 tool calls per turn"
    assert [m["name"] for m in obs.messages] == [
        "calculator",
        "tool_call",
        "python",
        "python",
        "python",
        "calculator",
    ]
    assert obs.metrics == {
        "tool_calls": 6,
        "tool_errors": 6,
        "tool_timeouts": 1,
        "tool_output_truncated": 1,
    }


def test_wrong_argument_types():
    obs = ToolEnvironment().step(
        _call("python", source="print(1)") + _call("calculator", expression=[1])
    )
    assert [m["content"] for m in obs.messages] == [
        'error: python needs a "code" string argument',
        'error: calculator needs an "expression" string argument',
    ]
    assert obs.metrics["tool_errors"] == 2


def test_a_number_is_an_expression_but_a_boolean_is_not():
    # Models often pass {"expression": 42}; JSON's true is not a number to compute.
    obs = ToolEnvironment().step(
        _call("calculator", expression=42) + _call("calculator", expression=2.5)
        + _call("calculator", expression=True)
    )  # fmt: skip
    assert [m["content"] for m in obs.messages] == [
        "42",
        "2.5",
        'error: calculator needs an "expression" string argument',
    ]
    assert obs.metrics["tool_errors"] == 1
