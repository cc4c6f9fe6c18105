"""The built-in tool-calling environment (`environment.function: tool_calling`).

The policy answers in turns; a turn with `<tool_call>` blocks (`tool_calls.py`) gets one
tool message per call, a turn without any ends the trajectory, and its text is the answer
the rule reward (`reward.function`) scores: `Observation.reward` stays 0 here. Tools: a
calculator (`calculator.py`) and a Python executor (`python_tool.py`), their schemas passed
to the chat template. Nothing the policy writes raises: a malformed call, a failing tool, a
timeout or a huge output becomes the tool's answer and a count in the metrics
(`tool_calls`, `tool_errors`, `tool_timeouts`, `tool_output_truncated`).

    environment:
      function: tool_calling
      kwargs: {prompt_key: question, system_prompt: "Use the tools.", python_wall_s: 5}
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rl_megatron.environments.base import Environment, Message, Observation
from rl_megatron.environments.calculator import calculate
from rl_megatron.environments.python_tool import PythonLimits, PythonResult, run_python
from rl_megatron.environments.tool_calls import parse_tool_calls, tool_message

__all__ = ["ToolEnvironment", "CALCULATOR_TOOL", "PYTHON_TOOL"]

CALCULATOR_TOOL = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression: numbers, + - * / // % ** and parentheses.",
        "parameters": {
            "type": "object",
            "properties": {
                "expression": {"type": "string", "description": "e.g. (3 + 4) * 2 ** 10"}
            },
            "required": ["expression"],
        },
    },
}

PYTHON_TOOL = {
    "type": "function",
    "function": {
        "name": "python",
        "description": (
            "Run a Python 3 script and return what it prints (stdout, then stderr). Each call is a "
            "fresh process without network access, with limits on time, memory and output; print "
            "the values you need."
        ),
        "parameters": {
            "type": "object",
            "properties": {"code": {"type": "string", "description": "the script to run"}},
            "required": ["code"],
        },
    },
}


class ToolEnvironment(Environment):
    """One trajectory with the calculator and the Python tool (module docstring)."""

    tools = [CALCULATOR_TOOL, PYTHON_TOOL]

    def __init__(
        self,
        prompt_key: str = "prompt",  # record field holding the question (when no "messages")
        system_prompt: str | None = None,  # prepended unless the record's messages have one
        max_calls_per_turn: int = 4,  # calls past it in one turn are answered, not run
        python_cpu_s: int = 5,
        python_wall_s: float = 10.0,
        python_memory_mb: int = 1024,
        python_output_bytes: int = 16 << 10,
        python_processes: int = 32,
    ):
        self.prompt_key = prompt_key
        self.system_prompt = system_prompt
        self.max_calls_per_turn = max_calls_per_turn
        self.limits = PythonLimits(
            cpu_s=python_cpu_s,
            wall_s=python_wall_s,
            memory_bytes=python_memory_mb << 20,
            output_bytes=python_output_bytes,
            processes=python_processes,
        )

    def start(self, sample: Mapping[str, Any]) -> list[Message]:
        if "messages" in sample:
            messages = [dict(m) for m in sample["messages"]]
        elif self.prompt_key in sample:
            messages = [{"role": "user", "content": str(sample[self.prompt_key])}]
        else:
            raise ValueError(
                f"tool_calling: the record has neither 'messages' nor {self.prompt_key!r} "
                f"(set environment.kwargs.prompt_key); its keys: {sorted(sample)}"
            )
        if self.system_prompt and not (messages and messages[0].get("role") == "system"):
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        return messages

    def step(self, response: str) -> Observation:
        calls = parse_tool_calls(response, known=[t["function"]["name"] for t in self.tools])
        if not calls:
            return Observation(done=True)
        metrics = {
            "tool_calls": len(calls),
            "tool_errors": 0,
            "tool_timeouts": 0,
            "tool_output_truncated": 0,
        }
        messages = []
        for i, call in enumerate(calls):
            name = call.name or "tool_call"
            if call.error is None and i >= self.max_calls_per_turn:
                call.error = f"not run: at most {self.max_calls_per_turn} tool calls per turn"
            if call.error is not None:
                metrics["tool_errors"] += 1
                messages.append(tool_message(name, f"error: {call.error}"))
            elif name == "calculator":
                text = self._calculator(call.arguments)
                metrics["tool_errors"] += text.startswith("error:")
                messages.append(tool_message(name, text))
            else:
                code = call.arguments.get("code")
                if not isinstance(code, str):
                    metrics["tool_errors"] += 1
                    messages.append(
                        tool_message(name, 'error: python needs a "code" string argument')
                    )
                    continue
                result = run_python(code, self.limits)
                failed = result.exit_status != 0 or result.killed_for is not None
                metrics["tool_errors"] += failed
                metrics["tool_timeouts"] += result.timed_out
                metrics["tool_output_truncated"] += result.output_truncated
                messages.append(tool_message(name, self._python_text(result)))
        return Observation(messages=messages, metrics={k: float(v) for k, v in metrics.items()})

    @staticmethod
    def _calculator(arguments: Mapping[str, Any]) -> str:
        expression = arguments.get("expression")
        if isinstance(expression, int | float) and not isinstance(expression, bool):
            expression = str(expression)
        if not isinstance(expression, str):
            return 'error: calculator needs an "expression" string argument'
        return calculate(expression)

    def _python_text(self, result: PythonResult) -> str:
        """What the model reads back: the output, then one bracketed line per thing that
        went wrong, so a cut or a kill is never mistaken for the program's own output."""
        parts = [result.stdout, result.stderr]
        notes = {
            "cpu": f"killed: CPU time limit of {self.limits.cpu_s} s",
            "wall": f"killed: wall-clock limit of {self.limits.wall_s:g} s",
            "memory": f"out of memory (limit {self.limits.memory_bytes >> 20} MB)",
            "output": None,
        }
        if result.output_truncated:
            parts.append(f"[output cut at {self.limits.output_bytes} bytes]")
        if notes.get(result.killed_for):
            parts.append(f"[{notes[result.killed_for]}]")
        elif result.exit_status not in (0, None) and result.killed_for is None:
            parts.append(f"[exit status {result.exit_status}]")
        text = "\n".join(p.rstrip("\n") for p in parts if p)
        return text or "(no output)"
