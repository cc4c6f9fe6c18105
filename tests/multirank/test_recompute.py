"""Activation recompute per role (`actor.recompute`, `critic.recompute`): what it saves, and
that it changes no number.

One rank builds the tiny demo model (4 layers, fp32) once per setting, all with the same
weights, and runs one forward and backward of the same loss:
  (a) every parameter's gradient equals the no-recompute gradient (5e-6 relative: recompute
      runs the same kernels on the same inputs; only the summation order may differ);
  (b) the bytes autograd saves for the backward (`saved_tensors_hooks`, each storage counted
      once) shrink as promised: full < selective(mlp) < none, and selective(core_attn) no
      more than none (with SDPA there is little in the attention to drop).
Through `build_roles` the actor and critic get their own setting and the reference none.
"""

from __future__ import annotations

import torch

from rl_megatron.parallel import ParallelGroups, ParallelLayout
from tests.spawn import run_on_ranks

SETTINGS = {
    "none": {},
    "core_attn": {"granularity": "selective", "modules": ["core_attn"]},
    "mlp": {"granularity": "selective", "modules": ["mlp"]},
    "full": {"granularity": "full", "num_layers": 1},
    "full_block": {"granularity": "full", "method": "block", "num_layers": 2},
}


def _saved_bytes_and_grads(chunk, tokens: torch.Tensor, weights: torch.Tensor):
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor):
        if t.device.type != "meta" and not isinstance(t, torch.nn.Parameter):
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    chunk.train()
    chunk.zero_grad(set_to_none=True)
    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits = chunk(tokens, positions, None)
        loss = (logits.float() * weights).sum()
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in chunk.named_parameters()}
    # Parameters are saved by reference: count the activations only.
    params = {p.untyped_storage().data_ptr() for p in chunk.parameters()}
    return sum(v for k, v in seen.items() if k not in params), grads


def _body(rank, world_size, tmp_path):
    from rl_megatron.config import RecomputeConfig, load_config
    from rl_megatron.distributed import distributed_run
    from rl_megatron.models.builders import build_gpt_chunks
    from rl_megatron.trainer.build import build_roles, model_info

    config = load_config(
        "yaml_configs/tiny_cpu.yaml",
        [
            "parallel.tp=1",
            "rollout.tp=1",
            "algorithm.adv_estimator=gae",
            "reference.enable=true",
            "actor.recompute.granularity=full",
            "critic.recompute.granularity=selective",
            "critic.recompute.modules=[mlp]",
        ],
    )
    info = model_info(config)
    with distributed_run(ParallelLayout(tp=1, pp=1, dp=1), seed=0):
        torch.manual_seed(0)
        base = build_gpt_chunks(info, ParallelLayout.from_megatron(), dtype=torch.float32)[0]
        state = base.state_dict()
        gen = torch.Generator().manual_seed(1)
        tokens = torch.randint(1, 100, (4, 48), generator=gen)
        weights = torch.randn(4, 48, base.output_layer.weight.shape[0], generator=gen)
        saved, grads = {}, {}
        for name, setting in SETTINGS.items():
            overrides = RecomputeConfig(**setting).transformer_config()
            chunk = build_gpt_chunks(
                info, ParallelLayout.from_megatron(), dtype=torch.float32, **overrides
            )[0]
            chunk.load_state_dict(state)
            assert chunk.config.recompute_granularity == (setting.get("granularity")), name
            saved[name], grads[name] = _saved_bytes_and_grads(chunk, tokens, weights)
        for name in SETTINGS:
            for key, g in grads[name].items():
                ref = grads["none"][key]
                err = (g - ref).abs().max() / ref.abs().max().clamp(min=1e-12)
                assert err < 5e-6, (name, key, float(err))
        print({k: round(v / 2**20, 3) for k, v in saved.items()}, "MiB saved for backward")
        assert saved["full"] < saved["mlp"] < saved["none"], saved
        assert saved["core_attn"] <= saved["none"], saved
        assert saved["full"] <= saved["full_block"] < saved["none"], saved

        roles = build_roles(config, info, 1, ParallelGroups.from_megatron())
        assert roles.actor.model[0].config.recompute_granularity == "full"
        assert roles.actor.model[0].config.recompute_method == "uniform"
        assert roles.critic.model[0].config.recompute_granularity == "selective"
        assert roles.critic.model[0].config.recompute_modules == ["mlp"]
        assert roles.reference.model[0].config.recompute_granularity is None


def test_recompute_settings_save_activations_and_change_no_gradient(tmp_path):
    run_on_ranks(_body, world_size=1, tmp_path=tmp_path)
