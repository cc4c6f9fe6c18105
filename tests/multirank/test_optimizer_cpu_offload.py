"""megatron-core's optimizer CPU offload (`optim.cpu_offload_fraction`) in `MegatronRole`.

A tiny bf16 Llama (2 layers, GQA, random init from a config written here) trains on 2 gloo
ranks with the distributed optimizer, at TP1·DP2 (each DP rank steps its own shard) and, for
(a), also at TP2·DP1:
  (a) with 1.0 of the optimizer offloaded (copies overlapped) and with 0.5 (not overlapped),
      four steps under LR warm-up and cosine decay, weight decay and gradient clipping give
      the default optimizer's losses and gradient norms (1e-5 relative), the same LR, its
      fp32 master weights (1e-4 of each tensor's largest update over the four steps) and
      Adam moments (1e-4 of each tensor's largest value); every bf16 weight is its master
      weight rounded (the CPU step reached the model); and the host share is the fraction
      asked for, by element count (megatron-core offloads whole parameters, in order, until
      the share is reached);
  (b) offloading params, grads and optimizer between phases frees the device share of the
      optimizer (0.5; nothing of it at 1.0) and leaves the host share's storages alone; a
      reload is bit-exact and the next step equals a never-offloaded twin's exactly;
  (c) a NaN loss on rank 1 with on_nonfinite=skip leaves every weight, master weight, moment
      and step count as it was, on both ranks;
  (d) a checkpoint saved after two steps (dp_reshardable, and fully_reshardable), or before
      any step, loads into a role with other weights bit-exactly, and the next step of both
      is bit-identical; a checkpoint of the default optimizer resumes with the offload and
      back (the stored tensors are the same), loaded bit-exactly, its next step as in (a).

On a CPU-only host megatron-core's `HybridDeviceOptimizer` cannot split at all: no
parameter `is_cuda`, so each counts as host memory without a device twin and its first step
fails (KeyError). `rl_megatron.cpu_compat` makes it split as on a GPU; both of its
sub-optimizers then run on the CPU as torch's fused AdamW (on a GPU with Transformer Engine
the device share runs TE's FusedAdam, not covered here).

Tolerances: the default optimizer here is torch's single-tensor AdamW, the offload's torch's
fused AdamW kernel: the same formula rounded differently in fp32 (observed: master weights
within 4e-6 of their update, moments equal); a lost LR, weight decay, clip or gradient is
off by O(1). Offloading and checkpoints copy bytes: exact.
"""

from __future__ import annotations

from pathlib import Path

import torch

from rl_megatron.parallel import MEGATRON_RANK_ORDER, ParallelLayout
from tests.multirank.test_training_state import _actor_loss, _batch, _write_hf_config
from tests.spawn import run_on_ranks

STEPS = 4
RTOL = 1e-4  # master weights (of the update) and moments (of their size), see above
METRIC_RTOL = 1e-5


def _setup(tp: int) -> None:
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()
    ps.initialize_model_parallel(tp, 1, order=MEGATRON_RANK_ORDER)


def _role(hf: Path, fraction: float, overlap: bool = True, seed: int = 0, **kw):
    """The actor at the current layout, bf16, its optimizer `fraction` offloaded."""
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from rl_megatron.config import OptimConfig
    from rl_megatron.models.builders import build_gpt_chunks
    from rl_megatron.models.hf_config import load_hf_config
    from rl_megatron.trainer.roles import MegatronRole

    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)
    chunks = build_gpt_chunks(
        load_hf_config(hf), ParallelLayout.from_megatron(), dtype=torch.bfloat16
    )
    optim = OptimConfig(
        lr=1e-2,
        adam_eps=1e-6,
        weight_decay=0.1,
        clip_grad=0.5,  # the gradient norm is ~2: every step clips
        lr_warmup_steps=2,
        lr_decay_style="cosine",  # a new LR at every step, which must reach the CPU Adam
        cpu_offload_fraction=fraction,
        cpu_offload_overlap=overlap,
    )
    return MegatronRole(chunks, optim=optim, micro_batch_size=2, total_steps=8, **kw)


def _rows() -> dict[str, torch.Tensor]:
    from megatron.core import parallel_state as ps

    size, rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    n = len(_batch()["prompts"]) // size
    return {k: v[rank * n : (rank + 1) * n] for k, v in _batch().items()}


def _hybrid(role):
    """The role's `HybridDeviceOptimizer` (one: a dense model has no expert optimizer)."""
    from rl_megatron.checkpoint.mcore_compat import hybrid_optimizers

    (hybrid,) = hybrid_optimizers(role.optimizer)
    return hybrid


def _shards(role) -> list[dict[str, torch.Tensor]]:
    """Each parameter's shard on this rank: bf16 `weight`, fp32 `master` weight and Adam
    state, in the same order with and without the offload."""
    from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer

    from rl_megatron.checkpoint.mcore_compat import inner_optimizers

    out = []
    for opt in inner_optimizers(role.optimizer):
        inner = opt.optimizer
        for weights, masters in zip(opt.shard_float16_groups, opt.shard_fp32_from_float16_groups):
            for weight, master in zip(weights, masters):
                if isinstance(inner, HybridDeviceOptimizer):
                    master, state = inner.param_to_fp32_param[weight], inner.state.get(weight, {})
                else:
                    state = inner.state.get(master, {})
                entry = {"weight": weight, "master": master}
                entry.update((k, state[k]) for k in ("exp_avg", "exp_avg_sq", "step") if k in state)
                out.append({k: v.detach().clone() for k, v in entry.items()})
    return out


def _assert_equal(what: str, a: list[dict], b: list[dict]) -> None:
    assert len(a) == len(b) > 5, f"{what}: {len(a)} vs {len(b)} shards"
    for i, (x, y) in enumerate(zip(a, b)):
        assert x.keys() == y.keys(), f"{what}: shard {i} holds {sorted(x)} vs {sorted(y)}"
        for key in x:
            assert torch.equal(x[key], y[key]), f"{what}: shard {i} {key} differs"


def _assert_close(what: str, got: list[dict], ref: list[dict], init: list[dict]) -> None:
    """`got` vs `ref` after the same steps from `init`: the tolerances of the docstring."""
    assert len(got) == len(ref) > 5, f"{what}: {len(got)} vs {len(ref)} shards"
    for i, (g, r, i0) in enumerate(zip(got, ref, init)):
        # Scaled by the reference's size; where that is 0 (at TP2 a vocabulary shard of
        # padding rows only: zero weights, no gradient), `got` must be exactly 0 too.
        checks = {"master": (g["master"] - r["master"], r["master"] - i0["master"])}
        checks.update((k, (g[k] - r[k], r[k])) for k in ("exp_avg", "exp_avg_sq"))
        for key, (diff, scale) in checks.items():
            err = diff.abs().max().item() / max(scale.abs().max().item(), 1e-30)
            assert err < RTOL, f"{what}: shard {i} {key} off by {err:.1e} of its scale"
        assert g["step"] == r["step"], f"{what}: shard {i} step {g['step']} vs {r['step']}"
        assert torch.equal(g["weight"], g["master"].bfloat16()), f"{what}: shard {i} weight"


def _check_split(what: str, role, fraction: float) -> None:
    """The host share is `fraction` of the elements: whole parameters, in order, until the
    share is reached (megatron-core's rule), so at most one parameter past it. The
    distributed optimizer itself keeps no fp32 copy of the weights (precision-aware): the
    hybrid optimizer's are the only ones, on the host for that share."""
    from rl_megatron.checkpoint.mcore_compat import inner_optimizers

    for opt in inner_optimizers(role.optimizer):
        own = [m for group in opt.shard_fp32_from_float16_groups for m in group]
        assert own and all(m is None for m in own), f"{what}: fp32 copies outside the offload"
    hybrid = _hybrid(role)
    params = [p for group in hybrid.param_groups for p in group["params"]]
    host = sum(p.numel() for opt in hybrid.cpu_optimizers for p in _params_of(opt))
    total, largest = sum(p.numel() for p in params), max(p.numel() for p in params)
    assert fraction * total <= host < fraction * total + largest, f"{what}: {host}/{total} on host"
    assert (hybrid.gpu_optimizer is None) == (fraction == 1.0), f"{what}: device optimizer"


def _params_of(opt) -> list[torch.Tensor]:
    return [p for group in opt.param_groups for p in group["params"]]


def _tensors_of(opt) -> list[torch.Tensor]:
    """A torch optimizer's weights and state tensors."""
    state = [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]
    return _params_of(opt) + state


# ---- (a) the default optimizer's steps -----------------------------------------------------


def _check_same_steps(hf: Path, layout: str) -> None:
    rows = _rows()
    ref = _role(hf, 0.0)
    init = _shards(ref)
    ref_metrics = [ref.train_step(rows, _actor_loss) for _ in range(STEPS)]
    ref_after = _shards(ref)
    for fraction, overlap in ((1.0, True), (0.5, False)):
        what = f"{layout}, fraction {fraction}"
        role = _role(hf, fraction, overlap)
        _check_split(what, role, fraction)
        metrics = [role.train_step(rows, _actor_loss) for _ in range(STEPS)]
        for step, (got, want) in enumerate(zip(metrics, ref_metrics)):
            assert got["lr"] == want["lr"], f"{what}: step {step} lr"
            for key in ("loss", "grad_norm"):
                err = abs(got[key] / want[key] - 1)
                assert err < METRIC_RTOL, f"{what}: step {step} {key} {got[key]} vs {want[key]}"
        _assert_close(what, _shards(role), ref_after, init)


# ---- (b) offload between phases -----------------------------------------------------------


def _storage_bytes(tensors: list[torch.Tensor]) -> int:
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage() for t in tensors}
    return sum(s.nbytes() for s in storages.values())


def _check_offloader(hf: Path) -> None:
    from rl_megatron.config import OffloadConfig

    rows = _rows()
    for fraction in (0.5, 1.0):
        what = f"offload between phases, fraction {fraction}"
        twin = _role(hf, fraction)
        role = _role(hf, fraction, offload=OffloadConfig(params=True, grads=True, optimizer=True))
        for r in (twin, role):
            r.train_step(rows, _actor_loss)
        hybrid = _hybrid(role)
        host = [t for opt in hybrid.cpu_optimizers for t in _tensors_of(opt)]
        device = _tensors_of(hybrid.gpu_optimizer) if hybrid.gpu_optimizer else []
        host_bytes, device_bytes = _storage_bytes(host), _storage_bytes(device)
        assert host_bytes > 0 and (device_bytes > 0) == (fraction < 1), what
        before = _shards(role)
        freed = role.offloader.offload(OffloadConfig(optimizer=True))
        assert freed == device_bytes, f"{what}: freed {freed} of the optimizer, not {device_bytes}"
        role.reload()
        assert role.offload() > 0
        assert _storage_bytes(device) == 0, f"{what}: the device share stayed"
        assert _storage_bytes(host) == host_bytes, f"{what}: the host share was moved"
        role.reload()
        _assert_equal(f"{what}: reload", _shards(role), before)
        m_twin, m_role = twin.train_step(rows, _actor_loss), role.train_step(rows, _actor_loss)
        assert (m_twin["loss"], m_twin["grad_norm"]) == (m_role["loss"], m_role["grad_norm"])
        _assert_equal(f"{what}: step after reload", _shards(role), _shards(twin))


# ---- (c) a non-finite step is skipped ------------------------------------------------------


def _check_nonfinite_skip(hf: Path) -> None:
    import torch.distributed as dist

    def nan_on_rank_1(outputs, mbatch, totals):
        loss, metrics = _actor_loss(outputs, mbatch, totals)
        return (loss * float("nan") if dist.get_rank() == 1 else loss), metrics

    rows = _rows()
    role = _role(hf, 0.5, on_nonfinite="skip")
    role.train_step(rows, _actor_loss)
    before = _shards(role)
    metrics = role.train_step(rows, nan_on_rank_1)
    assert metrics["skipped"] == 1 and metrics["update_successful"] == 0, metrics
    _assert_equal("after a skipped step", _shards(role), before)
    assert role.step_count == 1


# ---- (d) checkpoints -----------------------------------------------------------------------


def _check_resume(hf: Path, root: Path) -> None:
    from rl_megatron.checkpoint.training_state import CheckpointManager

    rows = _rows()
    cases = [  # name, saved fraction, loaded fraction, steps before the save, sharding
        ("offload", 0.5, 0.5, 2, "dp_reshardable"),
        ("offload, fully_reshardable", 1.0, 1.0, 2, "fully_reshardable"),
        ("offload, before any step", 1.0, 1.0, 0, "dp_reshardable"),
        ("default -> offload", 0.0, 1.0, 2, "dp_reshardable"),
        ("offload -> default", 0.5, 0.0, 2, "dp_reshardable"),
    ]
    for index, (what, saved, loaded, steps, sharding) in enumerate(cases):
        original = _role(hf, saved)
        for _ in range(steps):
            original.train_step(rows, _actor_loss)
        manager = CheckpointManager(root / str(index), optimizer_sharding=sharding)
        manager.save(steps, {"actor": original}, {})
        resumed = _role(hf, loaded, seed=1)  # other weights, which the load must replace
        manager.load(manager.latest(), {"actor": resumed})
        assert resumed.step_count == original.step_count == steps, what
        state = _shards(original)
        _assert_equal(f"{what}: loaded", _shards(resumed), state)
        m_orig, m_res = (
            original.train_step(rows, _actor_loss),
            resumed.train_step(rows, _actor_loss),
        )
        # The same weights: the same forward, backward and gradient norm, exactly.
        assert (m_orig["loss"], m_orig["grad_norm"]) == (m_res["loss"], m_res["grad_norm"]), what
        if saved == loaded:
            _assert_equal(f"{what}: next step", _shards(resumed), _shards(original))
        else:  # torch's fused vs single-tensor AdamW, as in (a)
            _assert_close(f"{what}: next step", _shards(resumed), _shards(original), state)


def _body(rank: int, world_size: int, hf: Path, root: Path) -> None:
    _setup(1)  # TP1·DP2: the distributed optimizer shards its state over the two ranks
    _check_same_steps(hf, "TP1·DP2")
    _check_offloader(hf)
    _check_nonfinite_skip(hf)
    _check_resume(hf, root)
    _setup(2)  # TP2·DP1: every rank steps its TP shard whole
    _check_same_steps(hf, "TP2·DP1")


def test_optimizer_cpu_offload(tmp_path):
    hf = _write_hf_config(tmp_path / "hf")
    run_on_ranks(_body, world_size=2, hf=hf, root=tmp_path / "checkpoints")
