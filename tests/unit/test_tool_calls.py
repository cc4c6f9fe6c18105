"""Parsing the `<tool_call>{...}</tool_call>` blocks a model writes."""

from __future__ import annotations

from rl_megatron.environments.tool_calls import parse_tool_calls, tool_message

KNOWN = ["calculator", "python"]


def test_no_call_is_an_empty_list():
    assert parse_tool_calls("The answer is 4.", KNOWN) == []


def test_two_calls_in_order():
    text = (
        "Let me compute.\n<tool_call>\n"
        '{"name": "calculator", "arguments": {"expression": "2+2"}}\n</tool_call>\n'
        '<tool_call>{"name": "python", "arguments": {"code": "print(1)"}}</tool_call>'
    )
    calls = parse_tool_calls(text, KNOWN)
    assert [(c.name, c.arguments, c.error) for c in calls] == [
        ("calculator", {"expression": "2+2"}, None),
        ("python", {"code": "print(1)"}, None),
    ]


def test_braces_and_newlines_inside_strings():
    text = '<tool_call>{"name": "python", "arguments": {"code": "d = {\'a\': {1: 2}}\nprint(d[\'a\'])"}}</tool_call>'
    (call,) = parse_tool_calls(text, KNOWN)
    assert call.error is None and call.arguments["code"] == "d = {'a': {1: 2}}\nprint(d['a'])"


def test_unicode_survives():
    text = (
        '<tool_call>{"name": "python", "arguments": {"code": "print(\'π ≈ 3.14 ✓\')"}}</tool_call>'
    )
    (call,) = parse_tool_calls(text, KNOWN)
    assert call.arguments["code"] == "print('π ≈ 3.14 ✓')"


def test_malformed_json_is_an_error_call_and_the_next_call_still_parses():
    text = (
        '<tool_call>{"name": "calculator", "arguments": {"expression": "1+1"</tool_call>'
        '<tool_call>{"name": "calculator", "arguments": {"expression": "3"}}</tool_call>'
    )
    bad, good = parse_tool_calls(text, KNOWN)
    assert bad.error.startswith("tool call is not valid JSON") and "\n" not in bad.error
    assert good.error is None and good.arguments == {"expression": "3"}


def test_unclosed_tag():
    (call,) = parse_tool_calls('text <tool_call>{"name": "calculator", "arguments": {}}', KNOWN)
    assert call.error.startswith("unclosed <tool_call> tag")


def test_unclosed_tag_before_a_closed_one():
    text = '<tool_call>{"name": "x"\n<tool_call>{"name": "python", "arguments": {"code": ""}}</tool_call>'
    first, second = parse_tool_calls(text, KNOWN)
    assert first.error.startswith("unclosed") and second.error is None and second.name == "python"


def test_missing_name_arguments_not_object_and_unknown_tool():
    text = (
        '<tool_call>{"arguments": {}}</tool_call>'
        '<tool_call>{"name": "calculator", "arguments": [1, 2]}</tool_call>'
        '<tool_call>{"name": "search", "arguments": {"q": "x"}}</tool_call>'
        "<tool_call>[1, 2]</tool_call>"
        '<tool_call>{"name": "", "arguments": {}}</tool_call>'
        '<tool_call>{"name": 5, "arguments": {}}</tool_call>'
    )
    errors = [c.error for c in parse_tool_calls(text, KNOWN)]
    assert errors == [
        'tool call has no "name" string',
        "\"arguments\" of tool call 'calculator' must be a JSON object",
        "unknown tool 'search' (tools: calculator, python)",
        'tool call must be a JSON object {"name": ..., "arguments": {...}}',
        'tool call has no "name" string',
        'tool call has no "name" string',
    ]


def test_arguments_as_a_json_string_are_accepted():
    text = '<tool_call>{"name": "calculator", "arguments": "{\\"expression\\": \\"5*5\\"}"}</tool_call>'
    (call,) = parse_tool_calls(text, KNOWN)
    assert call.error is None and call.arguments == {"expression": "5*5"}
    # Raw newlines inside its strings too (models write code that way), as in the body.
    text = '<tool_call>{"name": "python", "arguments": "{\\"code\\": \\"x = 1\nprint(x)\\"}"}</tool_call>'
    (call,) = parse_tool_calls(text, KNOWN)
    assert call.error is None and call.arguments == {"code": "x = 1\nprint(x)"}


def test_any_name_when_no_tool_list_is_given():
    (call,) = parse_tool_calls('<tool_call>{"name": "search", "arguments": {}}</tool_call>')
    assert call.error is None and call.name == "search"


def test_tool_message():
    assert tool_message("calculator", "4") == {"role": "tool", "name": "calculator", "content": "4"}
