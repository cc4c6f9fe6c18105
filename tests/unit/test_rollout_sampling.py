"""SamplingParams validation, logit filtering and batched seeded sampling, the prompt-overflow
policy, generation-replica layout, and the engine-interface state machine (weight versions,
partial updates, sleep/wake).

No vLLM here: `ReplicaLayout` is plain rank arithmetic, and the state machine is exercised
through a minimal in-memory engine that records what it was asked to do.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from rl_megatron.rollout.batch import RolloutBatch
from rl_megatron.rollout.engine import RolloutEngine
from rl_megatron.rollout.replicas import ReplicaLayout
from rl_megatron.rollout.sampling import (
    SamplingParams,
    filter_logits,
    fit_prompts,
    inverse_cdf_sample,
    sample_tokens,
    seed_tensor,
    seeded_uniform,
)

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
        ({"prompt_max_new_tokens": [4, 0]}, "sampling.prompt_max_new_tokens"),
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


def test_prompt_max_new_tokens_cap_each_prompt_and_must_cover_every_prompt():
    sp = SamplingParams(max_new_tokens=8, prompt_max_new_tokens=[3, 8, 20])
    assert sp.prompt_max_new_tokens == (3, 8, 20)  # a tuple: still hashable
    hash(sp)
    # min(max_new_tokens, the prompt's cap): a cap above max_new_tokens changes nothing.
    assert [sp.prompt_max_new(i) for i in range(3)] == [3, 8, 8]
    assert SamplingParams(max_new_tokens=8).prompt_max_new(5) == 8
    sp.check_prompt_seeds(3)
    with pytest.raises(ValueError, match="prompt_max_new_tokens holds 3 caps for 2 prompts"):
        sp.check_prompt_seeds(2)
    with pytest.raises(ValueError, match="prompt_max_new_tokens holds 3 caps for 2 prompts"):
        RecordingEngine().generate([[5], [6]], sp)  # every engine checks it


def test_prompt_limit():
    assert SamplingParams(max_new_tokens=10).prompt_limit(100) == 90
    assert SamplingParams(max_new_tokens=10, max_prompt_len=20).prompt_limit(100) == 20
    assert SamplingParams(max_new_tokens=99).prompt_limit(100) == 1  # one token of room
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


# ---- batched seeded sampling ----------------------------------------------------------

FILTERS = [  # (temperature, top_k, top_p): none, top-k, top-p, both
    (1.0, 0, 1.0),
    (0.7, 4, 1.0),
    (1.3, 0, 0.8),
    (0.9, 5, 0.7),
]


def _splitmix64_reference(seed: int, step: int) -> float:
    """`seeded_uniform` in Python's unbounded ints (mod 2^64), straight from the paper."""
    mask = (1 << 64) - 1

    def mix(z: int) -> int:
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
        return z ^ (z >> 31)

    z = mix((mix(seed & mask) + (step + 1) * 0x9E3779B97F4A7C15) & mask)
    return ((z >> 11) + 1) * 2.0**-53


def _filtered_probs(logits: torch.Tensor, sp: SamplingParams) -> torch.Tensor:
    """float64 softmax(logits / T) restricted to filter_logits' kept set, renormalised."""
    kept = torch.isfinite(filter_logits(logits, sp))
    p = torch.softmax(logits.double() / sp.temperature, -1) * kept
    return p / p.sum(-1, keepdim=True)


def _chi2_bound(dof: int) -> float:
    """Upper 1e-4 quantile of chi-square(dof), Wilson–Hilferty approximation (z = 3.719);
    within 3 % of the exact value for dof >= 1 and on the conservative side."""
    c = 2 / (9 * dof)
    return dof * (1 - c + 3.719 * c**0.5) ** 3


def test_seeded_uniform_is_splitmix64():
    seeds = [0, 1, 2, 12345, -7, 2**63 - 1, 2**64 + 5, 10**30]
    for step in (0, 1, 999):
        got = seeded_uniform(seed_tensor(seeds), step).tolist()
        assert got == [_splitmix64_reference(s, step) for s in seeds]
        assert all(0 < u <= 1 for u in got)


def test_inverse_cdf_never_picks_a_zero_probability_token():
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0]]).expand(5, 5)
    u = torch.tensor([2.0**-53, 0.25, 0.5, 0.5 + 2.0**-50, 1.0], dtype=torch.float64)
    assert inverse_cdf_sample(probs, u).tolist() == [1, 1, 1, 3, 3]
    # Masses need not sum to 1: u scales the total (here 4: token 0 owns (0, 1]).
    masses = torch.tensor([[1.0, 3.0]]).expand(3, 2)
    u = torch.tensor([0.25, 0.25 + 2.0**-40, 1.0], dtype=torch.float64)
    assert inverse_cdf_sample(masses, u).tolist() == [0, 1, 1]


@pytest.mark.parametrize("temperature, top_k, top_p", FILTERS)
def test_seeded_sampling_does_not_depend_on_the_batch(temperature, top_k, top_p):
    """Row r's token depends on (seed r, step, logits r) only: a batch split into pieces,
    reordered, or sampled one row at a time gives the same tokens and log-probs."""
    sp = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(10, 40, generator=g) * 2
    seeds = seed_tensor([1000 + 7 * r for r in range(10)])
    pieces = [[3, 0, 8], [9], [1, 2, 4, 5, 6, 7]]
    for step in (0, 5):
        tok, lp = sample_tokens(logits, sp, seeds=seeds, step=step)
        for rows in [*pieces, *([r] for r in range(10))]:
            t, lp_rows = sample_tokens(logits[rows], sp, seeds=seeds[rows], step=step)
            assert t.tolist() == tok[rows].tolist()
            torch.testing.assert_close(lp_rows, lp[rows], rtol=0, atol=1e-6)
    # Fresh draws per step and per seed: not one token everywhere.
    per_step = {sample_tokens(logits[:1], sp, seeds=seeds[:1], step=s)[0].item() for s in range(30)}
    assert len(per_step) > 1


@pytest.mark.parametrize("temperature, top_k, top_p", FILTERS)
def test_seeded_samples_follow_the_filtered_distribution(temperature, top_k, top_p):
    """Counts of many seeded draws from one fixed 8-token distribution match its filtered,
    renormalised probabilities: Pearson's chi-square below its 1e-4 upper quantile, and
    no draw of a filtered token. Two ways of drawing many samples: 20000 rows with
    consecutive seeds at one step (a GRPO group), and one row over 1500 steps."""
    sp = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.7, 0.3, 0.0, -0.5, -1.0]])
    probs = _filtered_probs(logits, sp)[0]
    kept = probs > 0
    across_rows = sample_tokens(
        logits.expand(20000, -1), sp, seeds=seed_tensor(range(500, 20500)), step=3
    )[0]
    one_row = torch.cat(
        [sample_tokens(logits, sp, seeds=seed_tensor([42]), step=s)[0] for s in range(1500)]
    )
    for draws in (across_rows, one_row):
        counts = torch.bincount(draws, minlength=8).double()
        assert counts[~kept].sum() == 0, f"filtered tokens drawn: {counts.tolist()}"
        expected = probs[kept] * len(draws)
        assert expected.min() >= 5  # Pearson's approximation holds
        chi2 = ((counts[kept] - expected) ** 2 / expected).sum().item()
        dof = int(kept.sum()) - 1
        assert chi2 < _chi2_bound(dof), (chi2, dof, counts.tolist(), expected.tolist())


@pytest.mark.parametrize("temperature, top_k, top_p", FILTERS)
def test_sampled_log_prob_is_the_filtered_renormalised_one(temperature, top_k, top_p):
    """The log-prob returned with each token (seeded or not) is log of its probability
    under the filtered, renormalised distribution; 1e-5: fp32 arithmetic on O(1) values."""
    sp = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(64, 50, generator=g) * 3
    probs = _filtered_probs(logits, sp)
    seeded = sample_tokens(logits, sp, seeds=seed_tensor(range(64)), step=0)
    unseeded = sample_tokens(logits, sp, generator=torch.Generator().manual_seed(0))
    for tok, lp in (seeded, unseeded):
        p = probs.gather(-1, tok[:, None])[:, 0]
        assert (p > 0).all(), "a filtered token was sampled"
        torch.testing.assert_close(lp.double(), p.log(), rtol=0, atol=1e-5)


def test_greedy_takes_the_argmax_with_its_plain_log_prob():
    logits = torch.randn(8, 30, generator=torch.Generator().manual_seed(3))
    tok, lp = sample_tokens(logits, SamplingParams(temperature=0), seeds=seed_tensor(range(8)))
    assert tok.tolist() == logits.argmax(-1).tolist()
    torch.testing.assert_close(lp, logits.log_softmax(-1).max(-1).values, rtol=0, atol=1e-6)


# ---- prompt overflow ------------------------------------------------------------------


def test_fit_prompts_truncate_left_keeps_the_end():
    prompts = [[1, 2, 3], list(range(10, 20)), [4]]
    fitted = fit_prompts(prompts, limit=4, policy="truncate_left")
    assert fitted.token_ids == [[1, 2, 3], [16, 17, 18, 19], [4]]
    assert fitted.truncated == [False, True, False] and fitted.num_truncated == 1
    assert fitted.num_rejected == 0
    for policy in ("truncate_left", "reject"):  # exactly at the limit: whole, not counted
        exact = fit_prompts([[1, 2, 3, 4]], limit=4, policy=policy)
        assert exact.token_ids == [[1, 2, 3, 4]]
        assert exact.num_truncated == exact.num_rejected == 0


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

    def sync_from(self, model_chunks, version: int) -> None:
        self.update_weights(
            {n: p for chunk in model_chunks for n, p in chunk.named_parameters()}, version
        )

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
    with pytest.raises(ValueError, match="sleep level must be 0, 1 or 2"):
        eng.sleep(level=3)


def test_engine_sleep_level_0_keeps_the_weights():
    eng = RecordingEngine()
    eng.update_weights({"w": torch.ones(1)}, version=1)
    eng.sleep(level=0)  # the KV cache goes; the weights, and their version, stay
    assert eng.awake_tags == {"weights"} and eng.weight_version == 1
    with pytest.raises(RuntimeError, match="asleep \\(kv_cache released\\)"):
        eng.generate([[5]], SamplingParams())
    eng.wake(["weights"])  # nothing to wake
    eng.update_weights({"w": torch.ones(1)}, version=2)  # written where they are
    eng.wake()
    assert eng.generate([[5]], SamplingParams()).weight_version == 2
    assert eng.calls == ["begin", "finish", "sleep0", "begin", "finish", "wake:kv_cache"]


# ---- the trainer's phases, as the engine turns them into sleep / wake --------------------


class RoomRecordingEngine(RecordingEngine):
    def _make_room(self, tags) -> None:
        self.calls.append("room:" + ",".join(tags))


def _parts():
    """A part timer recording the names it times, in order."""
    names: list[str] = []

    def part(name: str):
        names.append(name)
        return contextlib.nullcontext()

    return part, names


@pytest.mark.parametrize("level", [0, 1, 2])
def test_a_step_wakes_the_weights_for_the_sync_then_the_kv_cache(level):
    eng = RoomRecordingEngine()
    eng.sleep_level = level
    eng.release_for_training()
    assert eng.calls == [f"sleep{level}"]
    part, names = _parts()
    eng.calls.clear()
    eng.prepare_for_sync(part)
    asleep = level >= 1  # level 0 kept the weights on the device: nothing to wake
    assert eng.calls == (["room:weights", "wake:weights"] if asleep else [])
    assert names == ["make_room_for_weights", "wake_weights"]  # timed either way
    eng.calls.clear()
    names.clear()
    eng.prepare_for_generation(part)
    assert eng.calls == ["room:kv_cache", "wake:kv_cache"]
    assert names == ["make_room_for_kv_cache", "wake_kv_cache"]
    assert eng.awake_tags == {"weights", "kv_cache"}


def test_between_rounds_the_engine_keeps_its_weights_and_wakes_both():
    """Dynamic sampling: the next round generates with the same weights, no sync: a
    level-2 engine sleeps at 1 (a copy kept), then wakes the weights before the KV cache."""
    eng = RoomRecordingEngine()
    eng.sleep_level = 2
    eng.release_for_training(keep_weights=True)
    assert eng.calls == ["sleep1"] and eng.weight_version == 0
    eng.calls.clear()
    eng.prepare_for_generation()
    assert eng.calls == ["room:weights", "wake:weights", "room:kv_cache", "wake:kv_cache"]
    eng.sleep_level = 0
    eng.release_for_training(keep_weights=True)
    assert eng.calls[-1] == "sleep0"  # below 1 stays where it is


def test_prefetch_wakes_the_weights_only_when_they_fit():
    eng = RoomRecordingEngine()
    eng.sleep_level = 2
    eng.release_for_training()
    eng._has_room = lambda tags: False
    assert eng.prefetch_weights() is False and "weights" not in eng.awake_tags
    eng._has_room = lambda tags: True
    assert eng.prefetch_weights() is True and "weights" in eng.awake_tags
    assert eng.calls[-1] == "wake:weights" and "room:weights" not in eng.calls


def test_per_prompt_seeds_replace_the_spaced_ones():
    spaced = SamplingParams(max_new_tokens=4, n=2, seed=100)
    assert [spaced.prompt_seed(i) for i in range(3)] == [100, 102, 104]
    given = SamplingParams(max_new_tokens=4, n=2, seed=100, prompt_seeds=[7, 3, 11])
    assert [given.prompt_seed(i) for i in range(3)] == [7, 3, 11]
    assert SamplingParams(max_new_tokens=4).prompt_seed(0) is None
    seeded = SamplingParams(max_new_tokens=1, prompt_seeds=[1, 2])
    seeded.check_prompt_seeds(2)
    with pytest.raises(ValueError, match="sampling.prompt_seeds holds 2 seeds for 3 prompts"):
        seeded.check_prompt_seeds(3)


def test_the_smallest_legal_values_are_accepted():
    params = SamplingParams(
        max_new_tokens=1, max_prompt_len=1, stop_token_ids=[0], prompt_max_new_tokens=[1]
    )
    assert (params.max_new_tokens, params.max_prompt_len, params.stop_token_ids) == (1, 1, (0,))
    assert fit_prompts([[0]], limit=1, policy="reject", vocab_size=1).token_ids == [[0]]
