"""Mixtures of experts (Qwen3-MoE, Mixtral) on megatron-core's MoELayer, with EP and ETP.

Three tiny random HF models are made in the test (2 layers, 4 experts, top-2, perturbed
weights so a swapped tensor changes the logits): Qwen3-MoE with `norm_topk_prob` true and
false (megatron-core's default router vs `moe_router_pre_softmax`), and Mixtral.

* `test_moe_logits_and_export` (4 ranks): each model is loaded from safetensors at
  TP1 (every rank a whole model), TP2·ETP1 (experts replicated over TP), TP2·EP2,
  TP2·EP2·PP2 (with pp > 1 megatron-core needs ep·etp = tp in our rank order),
  EP4 (expert parallelism over the data-parallel ranks) and TP2·EP2·ETP2, and run forward
  (eval: megatron-core trains MoE at tp > 1 only with sequence parallelism); logits
  within 1e-4 of transformers' fp32 forward (observed ~1e-6: summation order only, the
  router's softmax over the top-k logits vs HF's renormalised top-k of the softmax). At
  TP1 and TP2·ETP1 the model is exported back (`hf_export`) bit-identically; at EP > 1 that
  export is refused in one line (the tools convert such checkpoints).
* `test_moe_tools_round_trip_at_ep2`: HF → Megatron with `hf_to_megatron.py --ep 2` on 2
  torchrun processes (each writing the experts it holds) → HF with `megatron_to_hf.py`
  (which reads one expert at a time), bit-identical.
* `test_moe_train_step_ep2_equals_ep1` (2 ranks, DP2): one PPO step of an actor role at EP2
  gives the same weight update as at EP1 (1e-4 of each tensor's largest update, the bound
  of test_roles.py), compared through dist_checkpointing in the EP1 layout.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from rl_megatron.parallel import ParallelGroups, ParallelLayout
from tests.multirank.test_hf_parity import _gather_vocab, _load_dir, _perturb
from tests.spawn import ON_GPU, run_on_ranks

V, S, B, MICRO = 100, 8, 4, 2
LOGIT_TOL = 1e-4
MODELS = ("qwen3_moe", "qwen3_moe_unnormed", "mixtral")
# (tp, pp, ep, etp) on 4 ranks
LAYOUTS = [(1, 1, 1, 1), (2, 1, 1, 1), (2, 1, 2, 1), (2, 2, 2, 1), (1, 1, 4, 1), (2, 1, 2, 2)]
EXPORT_LAYOUTS = {(1, 1, 1, 1), (2, 1, 1, 1)}
ROOT = __import__("pathlib").Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(ON_GPU, reason="CPU (gloo) test of the MoE layouts")


def _hf_configs():
    from transformers import MixtralConfig, Qwen3MoeConfig

    common = dict(
        vocab_size=V,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        max_position_embeddings=64,
    )
    qwen = dict(common, head_dim=32, intermediate_size=96, moe_intermediate_size=48)
    return {
        "qwen3_moe": Qwen3MoeConfig(
            **qwen, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True
        ),
        "qwen3_moe_unnormed": Qwen3MoeConfig(
            **qwen, num_experts=4, num_experts_per_tok=2, norm_topk_prob=False
        ),
        "mixtral": MixtralConfig(
            **common, intermediate_size=48, num_local_experts=4, num_experts_per_tok=2
        ),
    }


def _make_checkpoints(root):
    from transformers import AutoModelForCausalLM

    ids = torch.randint(1, V, (B, S), generator=torch.Generator().manual_seed(11))
    refs = {"ids": ids}
    for seed, (name, cfg) in enumerate(_hf_configs().items()):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()
        _perturb(model, seed)
        model.save_pretrained(root / name, safe_serialization=True)
        with torch.no_grad():
            refs[name] = model(ids).logits
    torch.save(refs, root / "refs.pt")


def _init(tp, pp, ep, etp):
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from rl_megatron.parallel import MEGATRON_RANK_ORDER

    ps.destroy_model_parallel()
    ps.initialize_model_parallel(
        tp,
        pp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
        order=MEGATRON_RANK_ORDER,
    )
    model_parallel_cuda_manual_seed(0)


def _forward(chunks, ids):
    from megatron.core.pipeline_parallel import get_forward_backward_func

    pos = torch.arange(S).expand(MICRO, S)
    micro = iter([(ids[i : i + MICRO], pos) for i in range(0, B, MICRO)])

    def step(data_iterator, model):
        i, p = next(data_iterator)
        return model(i, p, None), None

    with torch.no_grad():
        outs = get_forward_backward_func()(
            forward_step_func=step,
            data_iterator=micro,
            model=chunks,
            num_microbatches=B // MICRO,
            seq_length=S,
            micro_batch_size=MICRO,
            forward_only=True,
        )
    return torch.cat(outs) if outs else None


def _logits_body(rank: int, world_size: int, root) -> None:
    from megatron.core import parallel_state as ps

    from rl_megatron.checkpoint.hf_builders import build_actor
    from rl_megatron.checkpoint.hf_export import save_hf_checkpoint
    from rl_megatron.checkpoint.hf_loader import CheckpointError
    from rl_megatron.models.hf_config import load_hf_config

    refs = torch.load(root / "refs.pt")
    for tp, pp, ep, etp in LAYOUTS:
        _init(tp, pp, ep, etp)
        layout = f"tp{tp}pp{pp}ep{ep}etp{etp}"
        groups = ParallelGroups.from_megatron()
        for name in MODELS:
            chunks = build_actor(root / name, groups.layout, dtype=torch.float32)
            for chunk in chunks:
                chunk.eval()
            out = _forward(chunks, refs["ids"])
            if ps.is_pipeline_last_stage():
                err = (_gather_vocab(out) - refs[name]).abs().max().item()
                assert err < LOGIT_TOL, f"{name} {layout}: max abs logit error {err:.2e}"
            if (tp, pp, ep, etp) in EXPORT_LAYOUTS:
                out_dir = root / f"export_{name}_{layout}"
                save_hf_checkpoint(
                    chunks, load_hf_config(root / name), out_dir, groups, src_dir=root / name
                )
                if rank == 0:
                    a, b = _load_dir(root / name), _load_dir(out_dir)
                    assert a.keys() == b.keys(), f"{out_dir}: {sorted(a.keys() ^ b.keys())}"
                    for key in a:
                        assert torch.equal(a[key], b[key]), f"{out_dir}: {key} differs"
            elif ep > 1 and name == "mixtral":
                with pytest.raises(CheckpointError, match="parallel.ep > 1"):
                    save_hf_checkpoint(
                        chunks, load_hf_config(root / name), root / "x", groups, src_dir=root / name
                    )


@pytest.mark.slow
def test_moe_logits_and_export(tmp_path):
    _make_checkpoints(tmp_path)
    run_on_ranks(_logits_body, world_size=4, root=tmp_path)


def _tool(name: str, *args: str, nproc: int = 1) -> None:
    cmd = [sys.executable]
    if nproc > 1:
        cmd += ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    cmd += [str(ROOT / "checkpoints_tools" / f"{name}.py"), *args]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{name} failed:\n{proc.stderr[-3000:]}"


@pytest.mark.slow
def test_moe_tools_round_trip_at_ep2(tmp_path):
    _make_checkpoints(tmp_path)
    for name in ("qwen3_moe", "mixtral"):
        mcore, back = tmp_path / f"mcore_{name}", tmp_path / f"back_{name}"
        _tool("hf_to_megatron", "--hf-dir", str(tmp_path / name), "--out", str(mcore),
              "--ep", "2", "--dtype", "fp32", nproc=2)  # fmt: skip
        _tool("megatron_to_hf", "--ckpt", str(mcore), "--out", str(back))
        a, b = _load_dir(tmp_path / name), _load_dir(back)
        assert a.keys() == b.keys(), f"{name}: names differ: {sorted(a.keys() ^ b.keys())}"
        for key in a:
            assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), f"{name}: {key}"


def _train_body(rank: int, world_size: int, root) -> None:
    from megatron.core import dist_checkpointing

    from rl_megatron.checkpoint.hf_builders import build_actor
    from rl_megatron.trainer.roles import MegatronRole
    from tests.multirank import test_roles as tr

    batch = tr._batch()

    def actor():
        chunks = build_actor(
            root / "qwen3_moe", ParallelLayout.from_megatron(), dtype=torch.float32
        )
        return MegatronRole(
            chunks, optim=tr._optim(), temperature=tr.TEMPERATURE, micro_batch_size=2
        )

    for ep in (1, 2):
        _init(1, 1, ep, 1)
        role = actor()
        if ep == 1:
            lp = role.forward_only(batch)["log_prob"]
            noise = 0.3 * torch.randn(lp.shape, generator=torch.Generator("cpu").manual_seed(5))
            batch["old_log_prob"] = torch.where(batch["response_mask"].bool(), lp + noise, 0.0)
        metrics = role.train_step(tr._dp_rows(batch), tr._ppo_loss)
        assert metrics["grad_norm"] > 0
        path = root / f"step_ep{ep}"
        path.mkdir(exist_ok=True)
        dist_checkpointing.save(tr._sharded(role), str(path))

    _init(1, 1, 1, 1)
    role = actor()
    init = tr._params(role)

    def load(ep):
        loaded = dist_checkpointing.load(tr._sharded(role), str(root / f"step_ep{ep}"))
        return {f"0.{k}": v.clone() for k, v in loaded["chunk0"].items()}

    ep1, ep2 = load(1), load(2)
    assert ep1.keys() == init.keys()
    tr._assert_same_update("EP2 vs EP1", init, ep1, ep2)


@pytest.mark.slow
def test_moe_train_step_ep2_equals_ep1(tmp_path):
    _make_checkpoints(tmp_path)
    run_on_ranks(_train_body, world_size=2, root=tmp_path)
