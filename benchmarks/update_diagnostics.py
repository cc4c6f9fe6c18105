"""Where the trainer's actor update loses time against the plain megatron-core loop
(issue 19): `trainer_bench.py --update-diagnostics N` splits the update ÷ plain ratio of
`--interleave-update` into single factors, measured in the same process and rounds.

Four slots, each round running every slot once, or K times with
`--update-calls-per-round K` (`interleave_slots`, `ab.interleave`'s rounds for more than
two calls), each slot the same optimizer steps:

* `update`: the kept actor-update phase (`update_traces.step_with_actor_update`);
* `plain_on_actor`: the plain loop (`plain_loop.PlainLoop`) on the actor's own DDP chunks,
  optimizer and TransformerConfig, fed the update's own micro-batches (recorded as the
  actor's role built them, `recorded_micro_batches`, and replayed by
  `plain_loop.plain_micro_batches`: the same input ids and positions, no mask, labels the
  next tokens, megatron's cross-entropy); its steps change the actor's weights, as the
  update's own rounds do;
* `plain_update_batches`: the plain loop's own model on those micro-batches;
* `plain`: the plain loop on its random tokens, as in the A/B.

Adjacent slots isolate one difference each (`FACTORS`: `role_code`, `model`, `data`), and
their per-round ratios multiply to `total`, the update ÷ plain again; `same_tokens` is the
update ÷ the plain loop on the update's own micro-batches (an MoE's speed depends on the
tokens it routes: the fourteenth H200 run's `data` factor was 0.90–0.93). Also recorded: per
slot, its garbage-collector pauses and CUDA allocator calls (`phase_probes`); the fields
in which the actor's and the plain model's TransformerConfigs differ (`config_diff`), and
their modules' hooks, modes and parameters (`module_state`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import statistics
import time

import torch.distributed as dist
from ab import ABResult  # benchmarks/, on sys.path in the scripts
from bench_utils import sync
from phase_probes import GC_PAUSES, allocator_counts
from plain_loop import PlainLoop, plain_micro_batches

# The update ÷ plain gap as a product of single factors (`update_diagnostics`): per round,
# (A, B) slots whose ratio time(B) / time(A) isolates one difference; the first three
# multiply to the fourth exactly, round by round.
FACTORS = {
    "role_code": (
        "update",
        "plain_on_actor",
        "the update ÷ the plain loop on the actor's own model, optimizer and config and on "
        "the update's own micro-batches: our role code and loss (log-probs from the hidden "
        "states, PPO loss, metrics, finiteness-checked step), everything else the same",
    ),
    "model": (
        "plain_on_actor",
        "plain_update_batches",
        "the plain loop on the actor's model ÷ on its own, both on the update's "
        "micro-batches: the model instance (TransformerConfig, weights and routing, "
        "optimizer state, where its memory lies)",
    ),
    "data": (
        "plain_update_batches",
        "plain",
        "the plain loop on the update's micro-batches ÷ on its random tokens: the tokens "
        "(MoE routing balance, identical pad and prompt tokens) and the shapes (rows "
        "trimmed to the longest one)",
    ),
    "total": ("update", "plain", "the update ÷ the plain loop: the product of the three"),
    # Not a single factor (role_code × model): the like-for-like comparison for an MoE,
    # whose speed depends on which tokens it routes, so "the same work" is the same tokens.
    "same_tokens": (
        "update",
        "plain_update_batches",
        "the update ÷ the plain loop on the update's own micro-batches: the same tokens "
        "through the same shapes, our role code and model instance against megatron-core's",
    ),
}


def update_diagnostics(update, loop: PlainLoop, trainer, config, args, micro_batches) -> dict:
    """Where the update ÷ plain gap comes from: `FACTORS`' slots in the same rounds.

    update: the kept actor-update phase; loop: the plain loop beside it; micro_batches:
    the update's micro-batches as its role built them (`recorded_micro_batches`), which
    the plain loop replays (`plain_micro_batches`: the same input ids and positions,
    causal attention, labels the next tokens, megatron's cross-entropy). Also the
    actor's and the plain model's TransformerConfig fields that differ, and their
    modules' hooks and modes (`module_state`).
    """
    steps = [plain_micro_batches(m) for m in micro_batches]
    on_actor = PlainLoop(config, trainer.info, args, role=trainer.roles.actor)
    slots = {
        "update": update,
        "plain_on_actor": lambda: [on_actor.iteration(m) for m in steps],
        "plain_update_batches": lambda: [loop.iteration(m) for m in steps],
        "plain": lambda: [loop.iteration() for _ in steps],
    }
    seconds, orders, probes = interleave_slots(
        slots, args.update_diagnostics, calls_per_round=args.update_calls_per_round
    )
    factors = {}
    for name, (a, b, what) in FACTORS.items():
        first = [o.index(a) < o.index(b) for o in orders]
        ab = ABResult(
            a_s=seconds[a],
            b_s=seconds[b],
            a_first=first,
            calls_per_round=args.update_calls_per_round,
        )
        factors[name] = {"a": a, "b": b, "what": what, **ab.as_dict()}
    out = {
        "rounds": args.update_diagnostics,
        "calls_per_round": args.update_calls_per_round,
        "orders": orders,
        "slots": {
            name: {"s": seconds[name], "median_s": statistics.median(seconds[name]), **probes[name]}
            for name in slots
        },
        "factors": factors,
        "micro_batch_shapes": [[list(m["input_ids"].shape) for m in step] for step in steps],
        "config_diff": config_diff(trainer.roles.actor.config, loop.model_config),
        "module_state": {
            "actor": module_state(trainer.roles.actor.model),
            "plain": module_state(loop.model),
        },
    }
    if dist.get_rank() == 0:
        print(
            f"update ÷ plain, single factors ({args.update_diagnostics} rounds of "
            f"{args.update_calls_per_round} calls of each slot):",
            flush=True,
        )
        for name, f in factors.items():
            print(
                f"  {name:>9}: {f['a']} ÷ {f['b']}: median {f['ratio_median']:.3f} "
                f"[{f['ratio_min']:.3f}, {f['ratio_max']:.3f}]",
                flush=True,
            )
        diff = ", ".join(f"{k} {a} vs {b}" for k, (a, b) in out["config_diff"].items())
        print(f"  TransformerConfig, actor vs plain: {diff or 'identical'}", flush=True)
        state = out["module_state"]
        if state["actor"] != state["plain"]:
            print(f"  modules, actor vs plain: {state}", flush=True)
    return out


@contextlib.contextmanager
def recorded_micro_batches(role):
    """Within the block, every list of micro-batches `role` builds (one per optimizer step
    of `train_steps`) is appended to the list this yields, as the schedule gets it."""
    built: list = []
    original = role._micro_batches

    def record(*args, **kwargs):
        built.append(original(*args, **kwargs))
        return built[-1]

    role._micro_batches = record
    try:
        yield built
    finally:
        del role._micro_batches  # the class's method again


def interleave_slots(slots: dict, repeats: int, warmup: int = 1, calls_per_round: int = 1):
    """`ab.interleave` for more than two calls, each round running every slot
    `calls_per_round` times.

    Timed round r opens with the slots in their order rotated by r // 2, reversed when r
    is odd, so that over an even number of rounds every pair of slots runs in either order
    equally often and every slot takes every place; warm-up rounds use round 0's order and
    run each slot once. With K calls per round the round runs that order, then it reversed,
    then it again, and so on (K passes): with K even every slot's calls sum to the same
    positions, so a drift of the host's speed linear in time cancels inside the round (as
    `ab.round_order`'s A B B A does for two calls); a slot's time in a round is the sum of
    its K calls. Every call runs between two `sync()`s. Returns per slot its seconds in each
    timed round, each timed round's opening order, and per slot the garbage-collector pauses
    and CUDA allocator calls (`phase_probes`) summed over the timed rounds.
    """
    if calls_per_round < 1:
        raise ValueError(f"calls_per_round must be >= 1, got {calls_per_round}")
    names = list(slots)
    seconds: dict[str, list[float]] = {n: [] for n in names}
    probes = {n: {"gc_pause_s": 0.0} for n in names}
    orders: list[list[str]] = []
    for k in range(warmup + repeats):
        r = max(k - warmup, 0)
        j = (r // 2) % len(names)
        order = names[j:] + names[:j]
        if r % 2:
            order.reverse()
        passes = 1 if k < warmup else calls_per_round
        took_in_round = dict.fromkeys(names, 0.0)
        for p in range(passes):
            for name in order if p % 2 == 0 else order[::-1]:
                gc_before, alloc_before = GC_PAUSES.snapshot()[1], allocator_counts()
                sync()
                start = time.perf_counter()
                slots[name]()
                sync()
                took_in_round[name] += time.perf_counter() - start
                if k < warmup:
                    continue
                probes[name]["gc_pause_s"] += GC_PAUSES.snapshot()[1] - gc_before
                for key, count in allocator_counts().items():
                    probes[name][key] = probes[name].get(key, 0) + count - alloc_before[key]
        if k >= warmup:
            for name in names:
                seconds[name].append(took_in_round[name])
            orders.append(order)
    return seconds, orders, probes


def config_diff(a, b) -> dict[str, list[str]]:
    """The fields of two TransformerConfigs that differ: name -> [repr in a, repr in b]
    (initialisers are `functools.partial`s, one per config: compared by what they call)."""

    def same(x, y) -> bool:
        if isinstance(x, functools.partial) and isinstance(y, functools.partial):
            return (x.func, x.args, x.keywords) == (y.func, y.args, y.keywords)
        try:
            return bool(x == y)
        except Exception:  # noqa: BLE001 - e.g. tensors: compared by identity instead
            return x is y

    out = {}
    for f in dataclasses.fields(a):
        x, y = getattr(a, f.name, None), getattr(b, f.name, None)
        if not same(x, y):
            out[f.name] = [repr(x)[:120], repr(y)[:120]]
    return out


def module_state(chunks) -> dict[str, int]:
    """Counts over every submodule of `chunks`: hooks, training mode, instance-level
    `forward` overrides, routers with a replay hook, parameters (what could make the same
    layers run differently)."""
    mods = [m for c in chunks for m in c.modules()]
    return {
        "modules": len(mods),
        "training": sum(m.training for m in mods),
        "forward_pre_hooks": sum(len(m._forward_pre_hooks) for m in mods),
        "forward_hooks": sum(len(m._forward_hooks) for m in mods),
        "backward_hooks": sum(len(m._backward_hooks) + len(m._backward_pre_hooks) for m in mods),
        "forward_overrides": sum("forward" in vars(m) for m in mods),
        # megatron-core's routing-replay hook (`models/router_replay.py` sets it per forward)
        "router_replay_hooks": sum(getattr(m, "router_replay", None) is not None for m in mods),
        "parameters": sum(p.numel() for c in chunks for p in c.parameters()),
    }
