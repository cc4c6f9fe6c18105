"""A test environment: every turn that ends cleanly gets a tool message back, "seen N"
(N the turn's number), until `rollout.multi_turn.max_turns`; reward 0.25 per turn."""

from rl_megatron.environments.base import Environment, Observation


class SeenEnv(Environment):
    def start(self, sample):
        self.turns = 0
        return [{"role": "user", "content": sample["prompt"]}]

    def step(self, response):
        self.turns += 1
        return Observation(
            messages=[{"role": "tool", "content": f"seen {self.turns}"}],
            reward=0.25,
            metrics={"tool_calls": 1.0},
        )
