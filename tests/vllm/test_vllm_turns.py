"""`CoreTurns` / `follow_turns` (rollout/vllm/turns.py) on the scripted engine core of
test_vllm_core_loop.py: no model, so the requests each turn becomes (seed, budget, stop
ids, log-probs) and what the leader sends its TP peers are checked value by value. That
the trajectories are right on a real engine is test_vllm_multi_turn.py's."""

from __future__ import annotations

import pytest

from rl_megatron.rollout.multi_turn import turn_seed
from rl_megatron.rollout.sampling import SamplingParams
from rl_megatron.rollout.vllm.turns import CoreTurns, follow_turns
from tests.vllm.test_vllm_core_loop import core_output, make_loop

pytestmark = pytest.mark.vllm


class Channel:
    """A `LeaderChannel` stand-in: records what the leader sends, feeds a follower."""

    def __init__(self, is_leader=True, inbox=()):
        self.is_leader, self.size, self.sent, self.inbox = is_leader, 2, [], list(inbox)

    def send(self, obj):
        self.sent.append(obj)

    def receive(self):
        return self.inbox.pop(0)


def test_each_turn_is_one_request_seeded_by_its_trajectory_and_turn():
    def script(reqs):
        a, b = (r.request_id for r in reqs)
        yield [core_output(a, [5], logprobs=[-0.5]), core_output(b, [7], logprobs=[-0.25])]
        yield [core_output(a, [9], logprobs=[-0.75], finish="stop")]
        yield [core_output(b, [4, 3], logprobs=[-1.0, -2.0], finish="length")]

    loop, core = make_loop(script)
    channel = Channel()
    sampling = SamplingParams(temperature=0.5, max_new_tokens=99, seed=100)
    turns = CoreTurns(loop, sampling, [9, 2], channel, max_turns=4, first_trajectory=6)
    turns.submit("0-0", [1, 2], 8)
    turns.submit("3-2", [1, 3, 4], 3)
    # Seeds: seed + (6 + t) * max_turns + turn, whatever was submitted before.
    assert [r.sampling_params.seed for r in core.requests] == [124, 138]
    assert turn_seed(100, 9, 2, 4) == 138 and turn_seed(None, 9, 2, 4) is None
    assert [r.sampling_params.max_tokens for r in core.requests] == [8, 3]
    assert [r.sampling_params.stop_token_ids for r in core.requests] == [[9, 2], [9, 2]]
    assert [r.sampling_params.temperature for r in core.requests] == [0.5, 0.5]
    assert [r.sampling_params.n for r in core.requests] == [1, 1]
    assert [r.prompt_token_ids for r in core.requests] == [[1, 2], [1, 3, 4]]

    assert turns.finished(0.0) == []
    # The first step carries both adds to the followers; later steps none.
    assert [(m[0], [a[0] for a in m[1]]) for m in channel.sent] == [("step", ["0-0", "3-2"])]
    assert channel.sent[0][1][1][1] == [1, 3, 4]
    (turn,) = turns.finished(0.0)
    assert (turn.request_id, turn.token_ids, turn.logprobs, turn.finish_reason) == (
        "0-0",
        [5, 9],  # the stop token kept
        [-0.5, -0.75],
        "stop",
    )
    (turn,) = turns.finished(0.0)
    assert (turn.request_id, turn.token_ids, turn.logprobs) == (
        "3-2",
        [7, 4, 3],
        [-0.25, -1.0, -2.0],
    )
    assert turn.finish_reason == "length"
    assert channel.sent[1:] == [("step", []), ("step", [])]
    assert turns.steps == 3 and turns.finished(0.0) == []  # nothing runs: no step


def test_an_aborted_turn_raises():
    loop, _ = make_loop(lambda reqs: [[core_output(reqs[0].request_id, [], finish="abort")]])
    turns = CoreTurns(loop, SamplingParams(seed=1), [2], Channel(), max_turns=2)
    turns.submit("0-0", [1], 4)
    with pytest.raises(RuntimeError, match="returned 'abort' for turn 0-0"):
        turns.finished(0.0)


def test_a_follower_replays_the_leaders_adds_and_steps():
    def script(reqs):
        (a,) = (r.request_id for r in reqs)
        yield [core_output(a, [5])]
        yield [core_output(a, [6], finish="stop")]

    loop, core = make_loop(script)
    params = SamplingParams(seed=1)
    from rl_megatron.rollout.vllm.io import to_vllm_sampling_params

    like = to_vllm_sampling_params(params, [2], None, calculate_log_probs=False)
    inbox = [
        ("turns", like),  # the params every turn shares, once
        ("step", [("0-0", [1, 2], 7, 4)]),  # (request id, prompt, seed, max tokens)
        ("step", []),
        ("done", ("trajs", {"m": 1.0})),
    ]
    channel = Channel(is_leader=False, inbox=inbox)
    assert follow_turns(loop, channel) == ("trajs", {"m": 1.0})
    assert [r.prompt_token_ids for r in core.requests] == [[1, 2]]
    (request,) = core.requests
    assert (request.sampling_params.seed, request.sampling_params.max_tokens) == (7, 4)
    assert request.sampling_params.stop_token_ids == [2] and core.aborted == []

    loop, core = make_loop(lambda reqs: [[]])
    inbox = [("turns", like), ("step", [("0-0", [1], 7, 4)]), ("error", "ValueError: bad")]
    with pytest.raises(RuntimeError, match="failed on the leading rank: ValueError: bad"):
        follow_turns(loop, Channel(is_leader=False, inbox=inbox))
    assert core.aborted == [core.requests[0].request_id]  # the engine is left clean
