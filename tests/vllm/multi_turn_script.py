"""torchrun body of tests/vllm/test_vllm_multi_turn.py: multi-turn rollouts on one engine.

    python -m torch.distributed.run --nproc_per_node 2 tests/vllm/multi_turn_script.py \
        --spec spec.json --out outdir

The spec names a tiny HF checkpoint, a tokenizer directory (a chat template), the records
and the engine sizes. Each rank writes `outdir/rank{r}.json` with every trajectory.
"""

from __future__ import annotations

import argparse
import json
import os
import time
import traceback
from pathlib import Path
from typing import Any

import torch.distributed as dist

from rl_megatron.environments.base import Environment, Observation
from rl_megatron.rollout.multi_turn import MultiTurnSession, TurnBudget
from rl_megatron.rollout.sampling import SamplingParams
from rl_megatron.rollout.trajectory import ChatIncrements
from rl_megatron.rollout.vllm.engine import VllmEngine, VllmEngineArgs

SLOW_S = 3.0  # the slow record's first answer (margin for a loaded 2-core box)


def tool_message(turn: int) -> dict[str, str]:
    """The environment's answer to turn `turn` (the test renders it independently)."""
    return {"role": "tool", "content": f"result {turn} ok"}


class SlowForOne(Environment):
    """Answers every turn with `tool_message`; the record with "slow" waits SLOW_S before
    its first answer. Each answer records when it was given (`metrics["at_<turn>"]`)."""

    def start(self, sample):
        self.slow, self.turn = bool(sample.get("slow")), 0
        return [{"role": "user", "content": sample["question"]}]

    def step(self, response):
        if self.slow and self.turn == 0:
            time.sleep(SLOW_S)
        self.turn += 1
        return Observation(
            messages=[tool_message(self.turn)], metrics={f"at_{self.turn}": time.time()}
        )


def run(spec: dict[str, Any]) -> dict[str, Any]:
    from transformers import AutoTokenizer

    engine = VllmEngine(
        VllmEngineArgs(
            model=spec["ckpt"],
            tp=spec["tp"],
            dtype="float32",
            max_model_len=spec["max_model_len"],
            gpu_memory_utilization=0.05,
            seed=0,
            enforce_eager=True,
        )
    )
    tokenizer = AutoTokenizer.from_pretrained(spec["tokenizer"])
    increments = ChatIncrements(tokenizer, stop_token_ids=spec["stop_token_ids"])
    budget = TurnBudget(
        max_turns=spec["max_turns"],
        max_turn_tokens=spec["max_turn_tokens"],
        max_total_tokens=spec["max_model_len"],
    )
    session = MultiTurnSession(
        SlowForOne, "SlowForOne", increments, budget, timeout_s=60.0, max_concurrent=16
    )
    sampling = SamplingParams(
        temperature=spec["temperature"],
        max_new_tokens=spec["max_turn_tokens"],
        n=spec["n"],
        seed=11,
    )
    started = time.time()
    trajectories, metrics = engine.generate_trajectories(spec["records"], sampling, session)
    session.shutdown()
    return {
        "started": started,
        "metrics": metrics,
        "trajectories": [
            {
                "group": t.group,
                "sample": t.sample,
                "token_ids": t.token_ids,
                "loss_mask": t.loss_mask,
                "logprobs": t.logprobs,
                "prompt_length": t.prompt_length,
                "turns": t.turns,
                "observations": t.observations,
                "finish_reason": t.finish_reason,
                "error": t.error,
                "metrics": t.metrics,
            }
            for t in trajectories
        ],
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--spec", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    spec = json.loads(args.spec.read_text())
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    try:
        res = run(spec)
    except Exception:
        res = {"error": traceback.format_exc()}
    (args.out / f"rank{rank}.json").write_text(json.dumps(res))
    os._exit(0)  # vLLM's shutdown at exit is the teardown's job (engine docstring)


if __name__ == "__main__":
    main()
