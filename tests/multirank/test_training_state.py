"""Training checkpoints (`CheckpointManager`) on 2 gloo ranks, with a tiny Llama built here.

An actor and a critic at TP2 (random init from a 2-layer config) each take one training
step, then:
  (a) save → fresh roles (other seed) → load: every weight, fp32 master weight, Adam
      moment and step, the LR step count and the trainer state are bit-identical; one
      more step on the original and on the restored roles gives the same loss, the same
      grad norm and bit-identical weights;
  (b) the RNG streams (torch, Megatron's tracker, python, numpy) drawn after load equal
      those drawn right after the save;
  (c) keep_last=2 after three saves leaves the last two and `latest()` is the newest; a
      role offloaded at save time is saved whole and left offloaded;
  (d) a save SIGKILLed after its first role is written (a separate 2-rank run at TP1·DP2,
      stalled by a patched hook) leaves `latest()` on the previous checkpoint, which loads
      bit-exactly (it equals this run's own first step at TP1·DP2: same seed, same data);
      the next save succeeds and removes the leftover `.tmp-` directory;
  (e) an incomplete directory, a truncated tensor file, a missing role and a layout
      mismatch each raise `CheckpointError` naming the path, on both ranks;
  plus the checkpoint tools' view of `step_X/actor` (rl_megatron.json, hf/, the `model`
  keys megatron_to_hf.py loads), a save without helper processes, the directory rules of
  `latest()` without any rank, and (bonus) a `fully_reshardable` checkpoint resumed at
  TP1·DP2 (a dp_reshardable one is refused there).

Tolerance: none for (a)–(e): save and load copy bytes, and the same step on the same bytes
is the same. The resumed-at-TP1 steps: 1e-4 relative (`_check_reshard`).
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing as mp
import os
import random
import shutil
import signal
import time
from pathlib import Path

import pytest
import torch

from rl_megatron.parallel import MEGATRON_RANK_ORDER, ParallelLayout
from tests.multirank.test_roles import _value_loss
from tests.spawn import run_on_ranks

V, B, P, R = 100, 4, 4, 3
ROLES = ("actor", "critic")
KILL_TIMEOUT_S = 120


def _write_hf_config(path: Path) -> Path:
    """config.json of a 2-layer Llama (GQA): enough to build randomly initialised roles."""
    path.mkdir(parents=True)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": V,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 64,
        "rms_norm_eps": 1e-6,
        "torch_dtype": "float32",
    }
    (path / "config.json").write_text(json.dumps(config))
    (path / "tokenizer_config.json").write_text("{}")
    return path


def _batch() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    mask = torch.ones(B, R, dtype=torch.long)
    mask[1, 2:] = 0
    return {
        "prompts": torch.randint(1, V, (B, P), generator=gen),
        "responses": torch.randint(1, V, (B, R), generator=gen),
        "attention_mask": torch.ones(B, P + R, dtype=torch.long),
        "position_ids": torch.arange(P + R).expand(B, -1).clone(),
        "response_mask": mask,
        "old_log_prob": -4.6 + 0.3 * torch.randn(B, R, generator=gen),
        "advantages": torch.randn(B, R, generator=gen),
        "old_values": 0.1 * torch.randn(B, R, generator=gen),
        "returns": torch.randn(B, R, generator=gen),
    }


def _actor_loss(outputs, mbatch, totals):
    from rl_megatron.algorithms.losses import policy_loss

    return policy_loss(
        outputs["log_prob"],
        mbatch["old_log_prob"],
        mbatch["advantages"],
        mbatch["response_mask"],
        0.2,
        0.2,
        totals=totals,
    )


LOSSES = {"actor": _actor_loss, "critic": _value_loss}


def _roles(hf: Path, seed: int) -> dict:
    """Actor and critic at the current layout, randomly initialised from `seed`."""
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from rl_megatron.config import OptimConfig
    from rl_megatron.models.builders import ValueHead, build_gpt_chunks
    from rl_megatron.models.hf_config import load_hf_config
    from rl_megatron.trainer.roles import MegatronRole

    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)
    info = load_hf_config(hf)
    roles = {}
    for name in ROLES:
        chunks = build_gpt_chunks(
            info, ParallelLayout.from_megatron(), dtype=torch.float32, value_head=name == "critic"
        )
        for chunk in chunks:
            if isinstance(getattr(chunk, "output_layer", None), ValueHead):
                chunk.output_layer.reset_parameters(seed)
        # weight decay and clipping on, so the restored optimizer must get both right.
        optim = OptimConfig(lr=1e-2, adam_eps=1e-6, weight_decay=0.1, clip_grad=0.5)
        roles[name] = MegatronRole(chunks, optim=optim, micro_batch_size=2)
    return roles


def _train(roles: dict) -> dict[str, dict]:
    """One step of each role on this DP rank's rows of the batch."""
    from megatron.core import parallel_state as ps

    size, rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    rows = {k: v[rank * B // size : (rank + 1) * B // size] for k, v in _batch().items()}
    return {name: role.train_step(rows, LOSSES[name]) for name, role in roles.items()}


def _params(role) -> dict[str, torch.Tensor]:
    return {
        f"{i}.{n}": p.detach().clone()
        for i, chunk in enumerate(role.model)
        for n, p in chunk.module.named_parameters()
    }


def _optim_state(role) -> list[torch.Tensor]:
    """Master weights, Adam moments and steps of this rank's shard, in parameter order."""
    out = []
    for opt in getattr(role.optimizer, "chained_optimizers", [role.optimizer]):
        inner = opt.optimizer
        for group in inner.param_groups:
            out.append(torch.tensor([group["lr"], group["weight_decay"]]))
            for param in group["params"]:
                out.append(param.detach().clone())
                state = inner.state[param]
                out += [state[k].detach().clone() for k in ("exp_avg", "exp_avg_sq", "step")]
    return out


def _snapshot(roles: dict) -> dict:
    return {
        name: (_params(role), _optim_state(role), role.step_count) for name, role in roles.items()
    }


def _assert_same(what: str, a: dict, b: dict) -> None:
    for name in a:
        (pa, oa, sa), (pb, ob, sb) = a[name], b[name]
        assert pa.keys() == pb.keys()
        for key in pa:
            assert torch.equal(pa[key], pb[key]), f"{what}: {name} weight {key} differs"
        assert len(oa) == len(ob) and len(oa) > 10, f"{what}: {name} optimizer state size"
        for i, (x, y) in enumerate(zip(oa, ob)):
            assert torch.equal(x, y), f"{what}: {name} optimizer tensor {i} differs"
        assert sa == sb, f"{what}: {name} step_count {sa} vs {sb}"


def _draws() -> list:
    """One draw from each RNG stream a training step may use."""
    import numpy as np
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    with get_cuda_rng_tracker().fork():
        tracked = torch.rand(4)
    return [torch.rand(4), tracked, random.random(), np.random.rand(3).tolist()]


def _trainer_state(step: int) -> dict:
    return {"sampler": {"epoch": 0, "index": 8 * step}, "kl_ctrl": {"value": 0.05}}


def _sidecar(hf: Path) -> dict:
    common = {"format_version": 1, "dtype": "fp32", "padded_vocab_size": 256, "tp": 2}
    return {
        "actor": {**common, "head": "lm", "pp": 1, "vpp": None, "source": str(hf)},
        "critic": {**common, "head": "value", "pp": 1, "vpp": None, "source": str(hf)},
    }


def _setup(tp: int) -> None:
    from megatron.core import parallel_state as ps

    ps.destroy_model_parallel()
    ps.initialize_model_parallel(tp, 1, order=MEGATRON_RANK_ORDER)


# ---- (d) a save killed half-way ------------------------------------------------------------


def _doomed_body(rank: int, world_size: int, root: Path, hf: Path, markers: Path) -> None:
    """Save step 1, then stall step 2's save after its first role until SIGKILLed."""
    from rl_megatron.checkpoint import training_state as ts

    (markers / f"pid{rank}").write_text(str(os.getpid()))
    _setup(1)
    roles = _roles(hf, seed=0)
    _train(roles)
    manager = ts.CheckpointManager(root)
    manager.save(1, roles, _trainer_state(1))
    save_role = ts.CheckpointManager._save_role

    def stall(self, role_dir, role, sidecar, *part):
        save_role(self, role_dir, role, sidecar, *part)
        (markers / f"stalled{rank}").touch()
        time.sleep(KILL_TIMEOUT_S)

    ts.CheckpointManager._save_role = stall
    manager.save(2, roles, _trainer_state(2))
    raise AssertionError("the stalled save returned")


def _launch_doomed(root: Path, hf: Path, markers: Path) -> None:
    run_on_ranks(_doomed_body, world_size=2, root=root, hf=hf, markers=markers)


def _kill_during_save(root: Path, hf: Path) -> None:
    """Run `_doomed_body` and SIGKILL both ranks once the stalled save has begun."""
    markers = root.parent / "markers"
    markers.mkdir()
    launcher = mp.get_context("spawn").Process(target=_launch_doomed, args=(root, hf, markers))
    launcher.start()
    try:
        deadline = time.monotonic() + KILL_TIMEOUT_S
        while len(list(markers.glob("stalled*"))) < 2:
            assert launcher.is_alive(), "the doomed run died before its second save"
            assert time.monotonic() < deadline, "the doomed run never reached its second save"
            time.sleep(0.2)
    finally:  # the ranks, by the pids they wrote; then their launcher
        for pid_file in markers.glob("pid*"):
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid_file.read_text()), signal.SIGKILL)
        launcher.join(30)
        if launcher.is_alive():
            launcher.kill()
            launcher.join()


def _check_killed_root(root: Path, roles: dict, trained: dict) -> None:
    """(d) after the kill: the previous checkpoint loads; the next save cleans up."""
    import torch.distributed as dist

    from rl_megatron.checkpoint.training_state import CheckpointManager

    manager = CheckpointManager(root)
    assert manager.latest() == root / "step_00000001"
    step, state = manager.load(manager.latest(), roles)
    assert (step, state) == (1, _trainer_state(1))
    _assert_same("killed save: step 1", trained, _snapshot(roles))
    manager.save(2, roles, _trainer_state(2))
    dist.barrier()
    names = sorted(p.name for p in root.iterdir())
    assert names == ["step_00000001", "step_00000002"], names


# ---- (e) bad checkpoints ---------------------------------------------------------------------


def _expect_error(manager, path: Path, roles: dict, *needles: str) -> None:
    from rl_megatron.checkpoint.training_state import CheckpointError

    with pytest.raises(CheckpointError) as info:
        manager.load(path, roles)
    message = str(info.value)
    assert "\n" not in message, message
    for needle in (str(path), *needles):
        assert needle in message, f"'{needle}' not in: {message}"


def _check_bad_checkpoints(manager, good: Path, roles: dict) -> None:
    import torch.distributed as dist

    from rl_megatron.checkpoint import integrity

    bad = {k: good.parent / f"bad_{k}" for k in ("marker", "truncated", "layout")}
    if dist.get_rank() == 0:
        for path in bad.values():
            shutil.copytree(good, path)
        (bad["marker"] / "trainer_state.json").unlink()
        tensor_file = sorted((bad["truncated"] / "actor").glob("*.distcp"))[0]
        os.truncate(tensor_file, tensor_file.stat().st_size // 2)
        meta = json.loads((bad["layout"] / "trainer_state.json").read_text())
        meta["layout"].update(tp=1, dp=2)
        (bad["layout"] / "trainer_state.json").write_text(json.dumps(integrity.seal(meta)))
    dist.barrier()
    _expect_error(manager, bad["marker"], roles, "trainer_state.json", "not found")
    _expect_error(manager, bad["truncated"], roles, "truncated")
    _expect_error(manager, good, {"reward": roles["actor"]}, "no role 'reward'")
    _expect_error(manager, bad["layout"], roles, "tp=1", "tp=2", "checkpoint.allow_reshard")


# ---- the 2-rank body -------------------------------------------------------------------------


def _body(rank: int, world_size: int, root: Path, hf: Path) -> None:
    import torch.distributed as dist
    from megatron.core.dist_checkpointing import load_tensors_metadata
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    from rl_megatron.checkpoint.training_state import CheckpointManager
    from rl_megatron.config import OffloadConfig

    # (d) at TP1·DP2, where the distributed optimizer shards its state over DP.
    _setup(1)
    original = _roles(hf, seed=0)
    _train(original)
    _check_killed_root(root / "killed", _roles(hf, seed=5), _snapshot(original))

    _setup(2)
    roles = _roles(hf, seed=0)
    _train(roles)
    trained = _snapshot(roles)

    # (a), (b): save, draw, step; fresh roles, load, draw, step.
    manager = CheckpointManager(root / "run", keep_last=2)
    path = manager.save(1, roles, _trainer_state(1), sidecar=_sidecar(hf))
    # Written without helper processes (no writer forks, no multiprocessing Manager).
    assert not mp.active_children() and filesystem_async._results_queue is None
    after_save = _draws()
    reference = _train(roles)
    stepped = _snapshot(roles)

    fresh = _roles(hf, seed=1)
    actor_params = trained["actor"][0]
    assert any(not torch.equal(v, actor_params[k]) for k, v in _params(fresh["actor"]).items())
    step, state = manager.load(path, fresh)
    after_load = _draws()
    assert (step, state) == (1, _trainer_state(1))
    _assert_same("(a) loaded vs saved", trained, _snapshot(fresh))
    # Each stream was moved since the save (draws, reseeding by _roles): equal only if restored.
    for stream, x, y in zip(("torch", "tracker", "python", "numpy"), after_save, after_load):
        same = torch.equal(x, y) if torch.is_tensor(x) else x == y
        assert same, f"(b) {stream} RNG differs after load: {x} vs {y}"
    assert _train(fresh) == reference, "(a) the step after load differs"
    _assert_same("(a) stepped after load", stepped, _snapshot(fresh))

    # The checkpoint tools' view of step_X/actor (megatron_to_hf.py's preflight and keys).
    sidecar = json.loads((path / "actor" / "rl_megatron.json").read_text())
    assert sidecar == {**_sidecar(hf)["actor"], "dtype": "float32"}  # the tools' dtype name
    assert (path / "actor" / "hf" / "config.json").read_text() == (hf / "config.json").read_text()
    stored = load_tensors_metadata(str(path / "actor"))
    for item in roles["actor"].model[0].module.sharded_state_dict().values():
        if isinstance(item, ShardedTensor):
            assert tuple(stored[item.key].global_shape) == item.global_shape, item.key
        elif isinstance(item, ShardedTensorFactory):
            assert item.key in stored, item.key

    # (c) keep_last. Step 2 is saved while the critic is offloaded: reloaded for its part of
    # the save, offloaded again after.
    critic = roles["critic"]
    critic.offload_config = OffloadConfig(params=True, grads=True, optimizer=True)
    critic.offload()
    second = manager.save(2, roles, _trainer_state(2))
    assert critic.offloader.is_offloaded
    critic.reload()
    manager.load(second, fresh)
    _assert_same("saved while offloaded", _snapshot(roles), _snapshot(fresh))
    last = manager.save(3, roles, _trainer_state(3))
    assert manager.latest() == last == root / "run" / "step_00000003"
    assert sorted(p.name for p in (root / "run").iterdir()) == ["step_00000002", "step_00000003"]
    dist.barrier()  # both ranks have looked before the next save creates its .tmp- directory

    # Re-saving an existing step replaces it.
    manager.save(3, fresh, _trainer_state(4))
    assert manager.load(last, roles)[1] == _trainer_state(4)
    _assert_same("re-saved step", _snapshot(fresh), _snapshot(roles))

    # (e)
    _check_bad_checkpoints(manager, last, roles)
    _check_reshard(root, roles, hf, dp_only=last)


# ---- bonus: another layout -------------------------------------------------------------------


def _check_reshard(root: Path, roles: dict, hf: Path, dp_only: Path) -> None:
    """A fully_reshardable checkpoint saved at TP2·DP1 resumes at TP1·DP2.

    The next two steps match the TP2 run's loss and grad norm within 1e-4 relative: TP1·DP2
    sums in another order (observed ~1e-6 after one Adam update, which amplifies rounding of
    small gradients: eps = 1e-6). The second step checks the resharded Adam state, which
    the first update used: zeroed moments change its grad norm by ~1, a wrong Adam step
    count by ~5e-2 (measured).
    """
    from rl_megatron.checkpoint.training_state import CheckpointError, CheckpointManager

    manager = CheckpointManager(root / "reshard", optimizer_sharding="fully_reshardable")
    path = manager.save(4, roles, _trainer_state(4))
    reference = [_train(roles) for _ in range(2)]
    _setup(1)
    moved = _roles(hf, seed=9)
    with pytest.raises(CheckpointError, match="only DP may change"):
        manager.load(dp_only, moved, allow_reshard=True)
    assert manager.load(path, moved, allow_reshard=True) == (4, _trainer_state(4))
    for i, ref in enumerate(reference):
        got = _train(moved)
        for name in ROLES:
            for key in ("loss", "grad_norm"):
                a, b = got[name][key], ref[name][key]
                assert abs(a - b) <= 1e-4 * abs(b), f"resharded step {i} {name} {key}: {a} vs {b}"


@pytest.mark.slow
def test_training_state(tmp_path):
    """(a)–(e) of the module docstring, in one 2-rank run plus one killed 2-rank save."""
    from rl_megatron.checkpoint.training_state import CheckpointManager

    hf = _write_hf_config(tmp_path / "hf")
    killed = tmp_path / "killed"
    _kill_during_save(killed, hf)
    partial = sorted(p.name for p in killed.iterdir())
    assert partial[0] == "step_00000001" and partial[1].startswith("step_00000002.tmp-"), partial
    assert (killed / partial[1] / "actor" / "metadata.json").is_file()
    assert not (killed / partial[1] / "critic").exists()
    assert CheckpointManager(killed).latest() == killed / "step_00000001"

    run_on_ranks(_body, world_size=2, root=tmp_path, hf=hf)


def test_latest_skips_partial_directories(tmp_path):
    """`latest()` returns complete checkpoints only; a re-save's old copy is a fallback."""
    from rl_megatron.checkpoint.training_state import CheckpointManager

    def make(name: str, complete: bool = True) -> Path:
        path = tmp_path / name
        path.mkdir()
        if complete:
            (path / "trainer_state.json").write_text("{}")
        return path

    manager = CheckpointManager(tmp_path)
    assert manager.latest() is None
    make("step_00000003")
    make("step_00000004", complete=False)  # no marker: never returned
    make("step_00000009.tmp-0123abcd")  # unfinished save
    make("notes")
    assert manager.latest() == tmp_path / "step_00000003"
    old = make("step_00000005.old-0123abcd")  # killed between a re-save's renames
    assert manager.latest() == old
    final = make("step_00000005")
    assert manager.latest() == final
