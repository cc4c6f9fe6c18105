"""SamplingParams validation, the prompt-overflow policy, generation-replica layout, and the
engine-interface state machine (weight versions, partial updates, sleep/wake).

No vLLM here: `ReplicaLayout` is plain rank arithmetic, and the state machine is exercised
through a minimal in-memory engine that records what it was asked to do.
"""

from __future__ import annotations

import pytest
import torch

from rl_megatron.rollout.batch import RolloutBatch
from rl_megatron.rollout.engine import RolloutEngine
from rl_megatron.rollout.sampling import SamplingParams, filter_logits, fit_prompts
from rl_megatron.rollout.vllm_engine import ReplicaLayout

# ---- SamplingParams -------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, key",
    [
        ({"temperature": -0.1}, "sampling.temperature"),
        ({"top_p": 0.0}, "sampling.top_p"),
        ({"top_k": -2}, "sampling.top_k"),
        ({"max_new_tokens": 0}, "sampling.max_new_tokens"),
        ({"n": 0}, "sampling.n"),
        ({"prompt_overflow": "drop"}, "sampling.prompt_overflow"),
        ({"max_prompt_len": 0}, "sampling.max_prompt_len"),
        ({"stop_token_ids": [3, -1]}, "sampling.stop_token_ids"),
    ],
)
def test_sampling_errors_name_the_key(kwargs, key):
    with pytest.raises(ValueError, match=key.replace(".", r"\.")) as info:
        SamplingParams(**kwargs)
    assert "\n" not in str(info.value)


def test_sampling_defaults_and_normalisation():
    sp = SamplingParams(top_k=-1, stop_token_ids=[5, 6])
    assert sp.top_k == 0 and sp.stop_token_ids == (5, 6)
    hash(sp)  # frozen and hashable: usable as a cache key
    assert SamplingParams(temperature=0).greedy
    assert sp.resolved_stop_token_ids([2]) == (5, 6)
    assert SamplingParams().resolved_stop_token_ids([2, 9]) == (2, 9)
    assert SamplingParams(ignore_eos=True, stop_token_ids=[5]).resolved_stop_token_ids([2]) == ()


def test_prompt_limit():
    assert SamplingParams(max_new_tokens=10).prompt_limit(100) == 90
    assert SamplingParams(max_new_tokens=10, max_prompt_len=20).prompt_limit(100) == 20
    with pytest.raises(ValueError, match="leaves no room for a prompt"):
        SamplingParams(max_new_tokens=100).prompt_limit(100)


def test_filter_logits_against_naive_sets():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 20, generator=g) * 3
    for top_k, top_p in ((5, 1.0), (0, 0.6), (4, 0.5), (0, 1.0)):
        sp = SamplingParams(temperature=0.8, top_k=top_k, top_p=top_p)
        out = filter_logits(logits, sp)
        for row, x in zip(logits.tolist(), out):
            order = sorted(range(20), key=lambda i: -row[i])
            keep = order[:top_k] if top_k else order
            probs = torch.tensor([row[i] / 0.8 for i in keep]).softmax(0).tolist()
            # Nucleus: the shortest head of the (top-k) ranking holding >= top_p mass.
            mass, nucleus = 0.0, []
            for i, p in zip(keep, probs):
                nucleus.append(i)
                mass += p
                if top_p < 1 and mass >= top_p:
                    break
            assert set(torch.isfinite(x).nonzero()[:, 0].tolist()) == set(nucleus)
            finite = torch.isfinite(x)
            assert torch.allclose(x[finite], torch.tensor(row)[finite] / 0.8)


# ---- prompt overflow ------------------------------------------------------------------


def test_fit_prompts_truncate_left_keeps_the_end():
    prompts = [[1, 2, 3], list(range(10, 20)), [4]]
    fitted = fit_prompts(prompts, limit=4, policy="truncate_left")
    assert fitted.token_ids == [[1, 2, 3], [16, 17, 18, 19], [4]]
    assert fitted.truncated == [False, True, False] and fitted.num_truncated == 1
    assert fitted.num_rejected == 0


def test_fit_prompts_reject_counts_and_keeps_the_row():
    prompts = [list(range(10)), [1], list(range(5))]
    fitted = fit_prompts(prompts, limit=4, policy="reject")
    assert len(fitted.token_ids) == 3  # never dropped
    assert fitted.rejected == [True, False, True] and fitted.num_rejected == 2
    assert fitted.num_truncated == 0
    assert all(len(p) <= 4 for p in fitted.token_ids)


def test_fit_prompts_errors_name_the_prompt():
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        fit_prompts([[1], []], limit=4, policy="reject")
    with pytest.raises(ValueError, match=r"prompt 0 holds token id 128 outside .*\[0, 128\)"):
        fit_prompts([[1, 128]], limit=4, policy="reject", vocab_size=128)


# ---- generation replicas --------------------------------------------------------------


def test_replica_layout_whole_world():
    # World 8, t_g 2: 4 replicas of consecutive ranks, one prompt group.
    layouts = [ReplicaLayout.build(8, r, 2, None) for r in range(8)]
    assert [lay.replica_index for lay in layouts] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert all(lay.num_replicas == 4 for lay in layouts)
    assert [lay.is_replica_leader for lay in layouts[:2]] == [True, False]
    # 10 prompts over 4 replicas: 3 3 2 2, contiguous, covering everything once.
    shares = [layouts[2 * k].share(10) for k in range(4)]
    assert [list(s) for s in shares] == [[0, 1, 2], [3, 4, 5], [6, 7], [8, 9]]
    assert [len(layouts[0].share(1)), len(layouts[6].share(1))] == [1, 0]


def test_replica_layout_prompt_groups():
    # Two training DP replicas of 4 ranks each; t_g 2 gives 2 replicas per group.
    groups = [[0, 1, 2, 3], [4, 5, 6, 7]]
    lay = ReplicaLayout.build(8, 5, 2, groups)
    assert lay.group_ranks == (4, 5, 6, 7)
    assert (lay.replica_index, lay.num_replicas, lay.global_replica) == (0, 2, 2)
    with pytest.raises(ValueError, match="splits the generation replica of ranks"):
        ReplicaLayout.build(8, 0, 2, [[0, 2, 4, 6], [1, 3, 5, 7]])
    with pytest.raises(ValueError, match="must partition the ranks"):
        ReplicaLayout.build(4, 0, 1, [[0, 1], [1, 2, 3]])
    with pytest.raises(ValueError, match="rollout.tp=3 must divide the world size 4"):
        ReplicaLayout.build(4, 0, 3, None)


# ---- engine interface state machine ---------------------------------------------------


class RecordingEngine(RolloutEngine):
    """Holds weights in a dict; `generate` echoes prompts; can be told to fail a bucket."""

    def __init__(self) -> None:
        super().__init__(weight_version=0)
        self.weights: dict[str, torch.Tensor] = {}
        self.fail_next_bucket = False
        self.calls: list[str] = []

    def _begin_update(self) -> None:
        self.calls.append("begin")

    def _load_bucket(self, weights) -> None:
        if self.fail_next_bucket:
            raise OSError("link down")
        pairs = weights.items() if isinstance(weights, dict) else weights
        self.weights.update(pairs)

    def _finish_update(self) -> None:
        self.calls.append("finish")

    def _generate(self, prompt_token_ids, sampling, output_layout) -> RolloutBatch:
        rows = [list(p) for p in prompt_token_ids for _ in range(sampling.n)]
        return RolloutBatch.from_sequences(
            rows, [[1]] * len(rows), [[0.0]] * len(rows), ["stop"] * len(rows)
        )

    def _sleep(self, level: int) -> None:
        self.calls.append(f"sleep{level}")

    def _wake(self, tags) -> None:
        self.calls.append("wake:" + ",".join(tags))


def test_engine_records_the_weight_version():
    eng = RecordingEngine()
    assert eng.generate([[5]], SamplingParams()).weight_version == 0
    eng.update_weights({"w": torch.ones(1)}, version=3)
    assert eng.weight_version == 3 and eng.calls == ["begin", "finish"]
    assert eng.generate([[5]], SamplingParams(n=2)).weight_version == 3
    with pytest.raises(ValueError, match="version 2 is older than the engine's version 3"):
        eng.update_weights({}, version=2)
    with pytest.raises(ValueError, match="output_layout"):
        eng.generate([[5]], SamplingParams(), output_layout="rows")


def test_engine_refuses_to_generate_on_a_partial_update():
    eng = RecordingEngine()
    eng.begin_weight_update(1)
    eng.load_weights([("a", torch.zeros(1))])
    with pytest.raises(RuntimeError, match="middle of weight update to version 1"):
        eng.generate([[5]], SamplingParams())
    eng.fail_next_bucket = True
    with pytest.raises(OSError):
        eng.load_weights({"b": torch.zeros(1)})
    assert eng.weight_version is None and eng.updating
    with pytest.raises(RuntimeError, match="partial weight update \\(version 1: a bucket failed"):
        eng.generate([[5]], SamplingParams())
    with pytest.raises(RuntimeError, match="without begin_weight_update"):
        eng.load_weights({})
    eng.fail_next_bucket = False
    eng.update_weights({"a": torch.ones(1), "b": torch.ones(1)}, version=1)
    assert eng.generate([[5]], SamplingParams()).weight_version == 1


def test_engine_sleep_and_wake():
    eng = RecordingEngine()
    eng.sleep()  # level 1 keeps the weights' version
    with pytest.raises(RuntimeError, match="asleep \\(kv_cache, weights released\\)"):
        eng.generate([[5]], SamplingParams())
    eng.wake()
    assert eng.generate([[5]], SamplingParams()).weight_version == 0
    eng.sleep(level=2)  # level 2 discards them
    with pytest.raises(RuntimeError, match="weights are asleep"):
        eng.update_weights({}, version=1)
    eng.wake(["weights"])
    eng.update_weights({"w": torch.ones(1)}, version=1)
    with pytest.raises(RuntimeError, match="asleep \\(kv_cache released\\)"):
        eng.generate([[5]], SamplingParams())
    eng.wake(["kv_cache"])
    eng.wake()  # already awake: nothing to do
    assert eng.calls == [
        "sleep1",
        "wake:weights,kv_cache",
        "sleep2",
        "wake:weights",
        "begin",
        "finish",
        "wake:kv_cache",
    ]
    assert eng.generate([[5]], SamplingParams()).weight_version == 1
    with pytest.raises(ValueError, match="unknown wake tag 'gpu'"):
        eng.wake(["gpu"])
    with pytest.raises(ValueError, match="sleep level must be 1 or 2"):
        eng.sleep(level=3)
