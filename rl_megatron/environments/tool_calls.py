"""The tool calls a model writes, in the JSON-in-tags format of the Qwen2.5/Qwen3/Hermes
chat templates:

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "2**10"}}
    </tool_call>

Every block is parsed in order. A block the tools cannot run (bad JSON, no name, arguments
that are not an object, a tag left open, a tool that does not exist) comes back as a call
with `error` set to one line the model can read in the tool's answer; parsing never raises,
since the text is the policy's and may be anything.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

__all__ = ["ToolCall", "parse_tool_calls", "tool_message", "OPEN_TAG", "CLOSE_TAG"]

OPEN_TAG = "<tool_call>"
CLOSE_TAG = "</tool_call>"


@dataclass
class ToolCall:
    """One `<tool_call>` block: the tool's name and arguments, or why it cannot run."""

    name: str | None
    arguments: dict[str, Any] = field(default_factory=dict)
    error: str | None = None  # one line; None when the call can run


def parse_tool_calls(text: str, known: Collection[str] | None = None) -> list[ToolCall]:
    """Every tool call in `text`, in order; [] when there is none.

    known: the tool names that exist; a call to another name is an error call (None: any).
    """
    calls = []
    start = text.find(OPEN_TAG)
    while start != -1:
        body_start = start + len(OPEN_TAG)
        end = text.find(CLOSE_TAG, body_start)
        next_open = text.find(OPEN_TAG, body_start)
        if end == -1 or (next_open != -1 and next_open < end):
            # A block that never closes before the next one opens (or the text ends): the
            # model stopped mid-call; what follows is parsed on its own.
            calls.append(ToolCall(None, error=f"unclosed {OPEN_TAG} tag (no {CLOSE_TAG})"))
            start = next_open
            continue
        calls.append(_parse_block(text[body_start:end], known))
        start = text.find(OPEN_TAG, end + len(CLOSE_TAG))
    return calls


def _parse_block(body: str, known: Collection[str] | None) -> ToolCall:
    try:
        # strict=False: models put raw newlines inside JSON strings (Python code, mostly).
        payload = json.loads(body, strict=False)
    except ValueError as e:
        return ToolCall(None, error=f"tool call is not valid JSON: {e}")
    if not isinstance(payload, dict):
        return ToolCall(
            None, error='tool call must be a JSON object {"name": ..., "arguments": {...}}'
        )
    name = payload.get("name")
    if not isinstance(name, str) or not name:
        return ToolCall(None, error='tool call has no "name" string')
    arguments = payload.get("arguments", {})
    if isinstance(arguments, str):
        # The OpenAI wire format carries arguments as a JSON string; accept it when it
        # holds an object.
        with contextlib.suppress(ValueError):
            arguments = json.loads(arguments, strict=False)
    if not isinstance(arguments, dict):
        return ToolCall(name, error=f'"arguments" of tool call {name!r} must be a JSON object')
    if known is not None and name not in known:
        return ToolCall(
            name, arguments, error=f"unknown tool {name!r} (tools: {', '.join(sorted(known))})"
        )
    return ToolCall(name, arguments)


def tool_message(name: str, content: str) -> dict[str, str]:
    """A tool's answer as the chat message the template renders after the assistant's turn."""
    return {"role": "tool", "name": name, "content": content}
