"""Routing replay (R3, `models/router_replay.py`) into a Megatron MoE actor, on gloo ranks.

Two tiny Qwen3-MoE checkpoints made in the test (2 layers, 4 experts, top-2): the "rollout"
model A and the "training" model B, equal except for B's router weights (perturbed, so B
would route many tokens elsewhere). A's routing of each row is recorded one row at a time
(unpadded, the way an engine serves a request) by forward hooks on megatron-core's
routers, and the last token's is dropped (vLLM never forwards it).

* `test_replay_makes_top_k_sets_agree` (1 rank): B's forward of each row, its routers
  observed by the same hooks (not by the replay code): with A's routing replayed the top-k
  sets equal A's on every recorded (token, layer); without it, they differ on some. The
  gate weights the routers hand on are B's own softmax scores at the replayed experts,
  computed here from the routers' logits (`_expected_gates`), not through the replay code.
* `test_megatron_engine_records_the_routing` (1 rank): the Megatron engine with
  `record_routing` (greedy, n=2, a stop token that ends rows at different steps, three
  decode batches of different prompt widths, one rejected prompt) returns, for every row,
  the routing of its first prompt + response − 1 tokens equal to the hooks' routing of A's
  plain full-sequence forward of that row (exact top-k sets: KV-cache decoding and the full
  forward differ by ~1e-6 in fp32 router logits, and the reference's smallest lead of a
  chosen expert over the next is checked to exceed MIN_GAP = 1e-4), -1 everywhere else;
  recording does not change the tokens.
* `test_role_replays_the_rollout_routing` (2 ranks; DP2 left-aligned and packed
  micro-batches, PP2, EP2): `MegatronRole.forward_only` of a `RolloutBatch` carrying the
  routing gives the log-probs of B's per-row forward with A's routing replayed (the
  reference: 1e-5, fp32 summation order between padded / packed and single-row forwards),
  and, with `router_replay` off, the log-probs of B's own routing and a
  `routing_mismatch_frac` equal to the hooks' count (within one (token, layer) pair: a
  near-tie may flip between layouts). One training step with replay runs at each layout.
  First, sequence parallelism (`_check_replay_under_sp`): at the router level only, since
  a whole MoE model cannot run SP on CPU (the local spec's torch norms refuse it); what
  that leaves untested is megatron-core's SP token layout inside a real MoE layer (that
  its router sees this TP rank's consecutive `s / tp` columns), which DESIGN.md states.
"""

from __future__ import annotations

import pytest
import torch

from rl_megatron.parallel import ParallelLayout
from tests.multirank.test_hf_parity import _perturb
from tests.spawn import ON_GPU, run_on_ranks

V, LAYERS, TOPK = 100, 2, 2
PROMPTS = [[5, 17, 9], [33, 2, 71, 8, 60, 4], [12], [90, 45, 3, 3, 27]]
RESPONSES = [[40, 41, 42, 43], [7], [66, 19, 23], [88, 5]]
LOGPROB_TOL = 1e-5
MIN_GAP = 1e-4  # router logits: the reference's top-k must lead the rest by this

pytestmark = pytest.mark.skipif(ON_GPU, reason="CPU (gloo) test of routing replay")


def _make_checkpoints(root) -> None:
    from transformers import AutoModelForCausalLM

    from tests.multirank.test_moe import _hf_configs

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_hf_configs()["qwen3_moe"]).eval()
    _perturb(model, 0)
    model.save_pretrained(root / "a", safe_serialization=True)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.add_(0.1 * torch.randn(p.shape, generator=gen))
    model.save_pretrained(root / "b", safe_serialization=True)


class _Observer:
    """Forward hooks on every top-k router: the experts each token went to, per layer."""

    def __init__(self, model) -> None:
        from rl_megatron.models.router_replay import moe_routers

        self.sets: dict[int, torch.Tensor] = {}
        self.gaps: dict[int, float] = {}  # smallest lead of a chosen expert's logit
        self.gates: dict[int, torch.Tensor] = {}  # [tokens, experts]: the router's probs
        self.logits: dict[int, torch.Tensor] = {}  # [tokens, experts]: its gate's logits
        self.config = None
        self.handles = [
            router.register_forward_hook(self._hook(layer)) for layer, router in moe_routers(model)
        ]

    def _hook(self, layer):
        def hook(module, args, output):
            probs, routing_map = output  # [tokens, experts] float, bool
            idx = routing_map.nonzero()[:, 1].view(routing_map.shape[0], -1)
            self.sets[layer] = idx.sort(dim=-1).values
            logits = module.gating(args[0]).reshape(routing_map.shape).float()
            self.gates[layer], self.logits[layer] = probs.float(), logits
            self.config = module.config
            top = logits.topk(idx.shape[1] + 1, dim=-1).values
            self.gaps[layer] = float((top[:, -2] - top[:, -1]).min())

        return hook

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def _expected_gates(config, logits: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """The gate weights `[tokens, experts]` a softmax top-k router gives tokens routed to
    `experts` (`[tokens, k]`), from its logits, written from the formula: the softmax of
    the chosen experts' logits (pre-softmax off: Qwen3-MoE's norm_topk_prob), or the
    chosen experts' share of the softmax over all experts; 0 for the experts not chosen."""
    assert config.moe_router_score_function == "softmax", config.moe_router_score_function
    assert not config.moe_router_topk_scaling_factor
    if config.moe_router_pre_softmax:
        chosen = torch.softmax(logits, dim=-1).gather(1, experts)
    else:
        chosen = torch.softmax(logits.gather(1, experts), dim=-1)
    return torch.zeros_like(logits).scatter(1, experts, chosen)


def _replayed_experts(routing: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """The experts replay routes to (`[tokens, k]`): the recorded ones, the router's own
    top-k where the routing is -1."""
    own = logits.topk(routing.shape[-1], dim=-1).indices
    return torch.where((routing >= 0).all(-1, keepdim=True), routing.long(), own)


def _init(pp=1, ep=1):
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from rl_megatron.parallel import MEGATRON_RANK_ORDER

    ps.destroy_model_parallel()
    ps.initialize_model_parallel(1, pp, expert_model_parallel_size=ep, order=MEGATRON_RANK_ORDER)
    model_parallel_cuda_manual_seed(0)


def _row_forward(model, tokens, routing=None, observed=None):
    """One unpadded row through a whole model (pp = 1): its routing `[s, L, k]` as the
    hooks saw it and its next-token log-probs `[s - 1]`; `routing` replayed if given.
    observed: a list the hooks' `_Observer` is appended to."""
    import contextlib

    from rl_megatron.models.router_replay import replay_routing

    ids = torch.tensor([tokens])
    pos = torch.arange(len(tokens))[None]
    obs = _Observer(model)
    replay = replay_routing(model, routing[None]) if routing is not None else None
    with torch.no_grad(), replay or contextlib.nullcontext():
        logits = model(ids, pos, None).float()
    obs.remove()
    if observed is not None:
        observed.append(obs)
    seen = torch.stack([obs.sets[layer] for layer in range(LAYERS)], dim=1)
    log_probs = torch.log_softmax(logits[0, :-1, :V], -1)  # the vocabulary without padding
    log_probs = log_probs.gather(-1, ids[0, 1:, None])[:, 0]
    return seen, log_probs


def _rollout_routing(root):
    """A's routing of every row, recorded per row, last token dropped (as vLLM returns)."""
    from rl_megatron.checkpoint.hf_builders import build_actor

    model_a = build_actor(root / "a", ParallelLayout.from_megatron(), dtype=torch.float32)[0].eval()
    return [_row_forward(model_a, p + r)[0][:-1] for p, r in zip(PROMPTS, RESPONSES)]


def _agree_body(rank: int, world_size: int, root) -> None:
    from rl_megatron.checkpoint.hf_builders import build_actor

    _init()
    rollout = _rollout_routing(root)
    model_b = build_actor(root / "b", ParallelLayout.from_megatron(), dtype=torch.float32)[0].eval()
    differ = 0
    for i, (p, r) in enumerate(zip(PROMPTS, RESPONSES)):
        recorded = rollout[i]
        routing = torch.cat([recorded, torch.full((1, LAYERS, TOPK), -1)])  # last: own choice
        own, _ = _row_forward(model_b, p + r)
        observed = []
        replayed, _ = _row_forward(model_b, p + r, routing, observed)
        n = len(recorded)
        assert torch.equal(replayed[:n], recorded), f"row {i}: replayed routing differs"
        differ += int((own[:n] != recorded).any(-1).sum())
        # The gate weights: B's router's own scores at the replayed experts (the recorded
        # ones; its own top-k on the last token), from its logits in this forward.
        obs = observed[0]
        for layer in range(LAYERS):
            experts = _replayed_experts(routing[:, layer], obs.logits[layer])
            want = _expected_gates(obs.config, obs.logits[layer], experts)
            err = (obs.gates[layer] - want).abs().max().item()
            assert err < 1e-6, f"row {i} layer {layer}: gate weights off by {err:.2e}"
    assert differ > 0, "B's own routing equals A's: the test shows nothing"


def test_replay_makes_top_k_sets_agree(tmp_path):
    _make_checkpoints(tmp_path)
    run_on_ranks(_agree_body, world_size=1, root=tmp_path)


def _engine_body(rank: int, world_size: int, root) -> None:
    from rl_megatron.checkpoint.hf_builders import build_actor
    from rl_megatron.models.hf_config import load_hf_config
    from rl_megatron.rollout.megatron.engine import MegatronEngine
    from rl_megatron.rollout.sampling import SamplingParams
    from tests.multirank.test_megatron_engine_ep import _first_stop

    _init()
    info = load_hf_config(root / "a")
    model = build_actor(root / "a", ParallelLayout.from_megatron(), dtype=torch.float32)
    new = 6
    prompts = [*PROMPTS, list(range(3, 63))]  # the last is too long for 64 − 6: rejected
    plain = MegatronEngine(model, info, max_model_len=64, max_batch_size=3)
    free = plain.generate(PROMPTS, SamplingParams(temperature=0, max_new_tokens=new))
    stop = _first_stop([free.row_tokens(i)[1] for i in range(len(free))], 2)
    greedy = SamplingParams(temperature=0, n=2, max_new_tokens=new, stop_token_ids=[stop])
    expected = plain.generate(prompts, greedy)
    assert expected.routed_experts is None
    engine = MegatronEngine(model, info, max_model_len=64, max_batch_size=3, record_routing=True)
    batch = engine.generate(prompts, greedy)
    assert not engine.use_cuda_graphs
    assert torch.equal(batch.responses, expected.responses), "recording changed the tokens"
    reasons = set(batch.finish_reasons)
    assert {"stop", "length", "rejected"} <= reasons, reasons
    assert len({int(n) for n in batch.response_lengths[:-2]}) > 1, batch.response_lengths

    routing = batch.routed_experts  # [B, P + R, L, k]
    width = batch.prompts.shape[1]
    assert routing.dtype == torch.int16
    assert routing.shape == (len(batch), width + batch.responses.shape[1], LAYERS, TOPK)
    compared = 0
    for i in range(len(batch)):
        prompt, response = batch.row_tokens(i)
        if batch.finish_reasons[i] == "rejected":
            assert (routing[i] == -1).all(), f"row {i}: rejected, yet routing recorded"
            continue
        n, start = len(prompt) + len(response) - 1, width - len(prompt)
        got = routing[i, start : start + n].long().sort(dim=-1).values
        outside = torch.cat([routing[i, :start], routing[i, start + n :]])
        assert (outside == -1).all(), f"row {i}: routing outside its first {n} tokens"
        model[0].eval()
        obs = _Observer(model[0])
        with torch.no_grad():
            model[0](torch.tensor([prompt + response]), torch.arange(n + 1)[None], None)
        obs.remove()
        assert min(obs.gaps.values()) > MIN_GAP, f"row {i}: near-tie {obs.gaps}"
        seen = torch.stack([obs.sets[layer] for layer in range(LAYERS)], dim=1)[:n]
        for layer in range(LAYERS):
            bad = (got[:, layer] != seen[:, layer]).any(-1).nonzero()[:, 0].tolist()
            assert not bad, f"row {i} layer {layer}: tokens {bad} routed differently"
        compared += n
    assert compared > 0


def test_megatron_engine_records_the_routing(tmp_path):
    _make_checkpoints(tmp_path)
    run_on_ranks(_engine_body, world_size=1, root=tmp_path)


def _references(root, rollout):
    """B's per-row response log-probs with A's routing replayed and with its own, and the
    (token, layer) pairs where B's own routing differs from A's (and of how many)."""
    from rl_megatron.checkpoint.hf_builders import build_actor

    model_b = build_actor(root / "b", ParallelLayout.from_megatron(), dtype=torch.float32)[0].eval()
    replayed, own, differ, recorded = [], [], 0, 0
    for i, (p, r) in enumerate(zip(PROMPTS, RESPONSES)):
        routing = torch.cat([rollout[i], torch.full((1, LAYERS, TOPK), -1)])
        _, lp = _row_forward(model_b, p + r, routing)
        replayed.append(lp[len(p) - 1 :])
        seen, lp = _row_forward(model_b, p + r)
        own.append(lp[len(p) - 1 :])
        differ += int((seen[:-1] != rollout[i]).any(-1).sum())
        recorded += rollout[i].shape[0] * LAYERS
    return replayed, own, differ / recorded, 1 / recorded


def _role_body(rank: int, world_size: int, root) -> None:
    from rl_megatron.checkpoint.hf_builders import build_actor
    from rl_megatron.config import OptimConfig
    from rl_megatron.rollout.batch import RolloutBatch
    from rl_megatron.trainer.experience import training_batch
    from rl_megatron.trainer.roles import MegatronRole

    _check_replay_under_sp(root, rank, world_size)
    _init()
    rollout = _rollout_routing(root)
    replayed, own, frac, one_pair = _references(root, rollout)
    batch = training_batch(
        RolloutBatch.from_sequences(
            PROMPTS, RESPONSES, None, ["length"] * len(PROMPTS), routed_experts=rollout
        )
    )
    for pp, ep, pack in ((1, 1, False), (1, 1, True), (2, 1, False), (1, 2, False)):
        if pp * ep > world_size:
            continue
        _init(pp, ep)
        where = f"pp{pp} ep{ep} pack={pack}"
        for replay, expected in ((True, replayed), (False, own)):
            chunks = build_actor(root / "b", ParallelLayout.from_megatron(), dtype=torch.float32)
            role = MegatronRole(
                chunks, micro_batch_size=2, pack_sequences=pack, router_replay=replay
            )
            role.compare_routing = True
            log_prob = role.forward_only(batch)["log_prob"]
            for i, ref in enumerate(expected):
                err = (log_prob[i, : len(ref)] - ref).abs().max().item()
                assert err < LOGPROB_TOL, f"{where} replay={replay} row {i}: {err:.2e}"
            got = role.routing_mismatch_frac()
            if not replay:
                assert abs(got - frac) <= one_pair + 1e-12, f"{where}: mismatch {got} vs {frac}"
        trained = MegatronRole(
            build_actor(root / "b", ParallelLayout.from_megatron(), dtype=torch.float32),
            optim=OptimConfig(lr=1e-4),
            micro_batch_size=2,
            pack_sequences=pack,
            router_replay=True,
        )
        metrics = trained.train_step(
            {**batch, "advantages": torch.ones_like(batch["response_mask"], dtype=torch.float)},
            lambda out, mb, totals: ((-out["log_prob"] * mb["response_mask"]).sum() / 64, {}),
        )
        assert metrics["update_successful"] == 1.0, f"{where}: {metrics}"


def _check_replay_under_sp(root, rank: int, world_size: int) -> None:
    """Sequence parallelism over a TP group of every rank, at the router: each rank's
    router sees its `s / tp` consecutive columns of a `[s, b, h]` input and, given its rank
    in the TP group, replays those columns' recorded experts with its own scores at them,
    and counts their mismatches.
    A whole model cannot run SP on CPU (the local spec's torch norms refuse it), so this is
    the router of B's first layer called directly on each rank's part of the sequence."""
    from rl_megatron.checkpoint.hf_builders import build_actor
    from rl_megatron.models.router_replay import RoutingStats, moe_routers, replay_routing

    _init()
    model = build_actor(root / "b", ParallelLayout.from_megatron(), dtype=torch.float32)[0].eval()
    (layer, router), *_ = moe_routers(model)
    tp = torch.distributed.new_group(list(range(world_size)))
    b, width, hidden, experts = 2, 3, router.config.hidden_size, router.config.num_moe_experts
    s = width * world_size
    gen = torch.Generator().manual_seed(5)  # the same input and routing on every rank
    x = torch.randn(s, b, hidden, generator=gen)  # sequence-first, as routers see it
    routing = torch.rand(b, s, LAYERS, experts, generator=gen).argsort(-1)[..., :TOPK]
    routing[0, 1] = -1  # the router's own choice on a token of each rank's columns
    routing[1, s - 1] = -1
    mine = x[rank * width : (rank + 1) * width]
    stats = RoutingStats()
    sp_rank, sp_size = torch.distributed.get_rank(tp), torch.distributed.get_world_size(tp)
    with (
        torch.no_grad(),
        replay_routing(model, routing, stats=stats, sp_rank=sp_rank, sp_size=sp_size),
    ):
        gates, routing_map = router(mine)
    # Token (row i, column j) of this rank's columns is number (j - first column)·b + i.
    recorded = routing[:, rank * width : (rank + 1) * width, layer].transpose(0, 1)
    recorded = recorded.reshape(-1, TOPK)
    logits = torch.nn.functional.linear(mine, router.weight, router.bias).reshape(-1, experts)
    want = _replayed_experts(recorded, logits)
    got = routing_map.nonzero()[:, 1].view(-1, TOPK)
    assert torch.equal(got, want.sort(-1).values), f"rank {rank}: SP replay routed {got}"
    err = (gates.float() - _expected_gates(router.config, logits, want)).abs().max().item()
    assert err < 1e-6, f"rank {rank}: SP gate weights off by {err:.2e}"
    known = (recorded >= 0).all(-1)
    own = logits.topk(TOPK, dim=-1).indices.sort(-1).values
    differ = (own != recorded.sort(-1).values).any(-1) & known
    assert (int(stats.recorded), int(stats.mismatched)) == (int(known.sum()), int(differ.sum()))


@pytest.mark.slow
def test_role_replays_the_rollout_routing(tmp_path):
    _make_checkpoints(tmp_path)
    run_on_ranks(_role_body, world_size=2, root=tmp_path)
