"""Resuming a checkpoint at settings it cannot load at: one line naming the key, no KeyError.

A tiny Qwen3-MoE actor (2 layers, 4 experts, top-2, random init) on 2 gloo ranks at
TP1·DP2 takes one training step at parallel.ep=2 and is saved (`CheckpointManager`, the
trainer's dp_reshardable optimizer state, with its sidecar). Then:
  * the layout record holds every degree (tp, pp, vpp, dp, cp, ep, etp, sequence
    parallelism) and the role's model.dtype, and resumes at ep=2 bit for bit;
  * at ep=1 the resume is refused in one line naming parallel.ep (with and without
    checkpoint.allow_reshard: megatron-core cannot reshard the experts' optimizer state);
  * a bf16 role is refused in one line naming model.dtype (from the record; from the
    sidecar for a record without dtype);
  * an older record (no vpp / ep / etp / sequence_parallel / dtype) still resumes at ep=2;
    at ep=1, or at bf16 without a sidecar, megatron-core's KeyError of optimizer keys
    (kilobytes on one line) becomes one short line naming parallel.ep and model.dtype.
And through launch/ppo.py (`test_launcher_...`): the exact line users see, exit code 2.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from rl_megatron.parallel import ParallelLayout
from tests.multirank import test_training_state as tts
from tests.spawn import ON_GPU, run_on_ranks

pytestmark = pytest.mark.skipif(ON_GPU, reason="CPU (gloo) test of resume refusals")


def _write_moe_config(path: Path) -> Path:
    path.mkdir(parents=True)
    config = {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "vocab_size": tts.V,
        "hidden_size": 64,
        "intermediate_size": 96,
        "moe_intermediate_size": 48,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "max_position_embeddings": 64,
        "rms_norm_eps": 1e-6,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "norm_topk_prob": True,
        "torch_dtype": "float32",
    }
    (path / "config.json").write_text(json.dumps(config))
    return path


def _init(ep: int) -> None:
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from rl_megatron.parallel import MEGATRON_RANK_ORDER

    ps.destroy_model_parallel()
    ps.initialize_model_parallel(
        1, 1, expert_model_parallel_size=ep, expert_tensor_parallel_size=1,
        order=MEGATRON_RANK_ORDER,
    )  # fmt: skip
    model_parallel_cuda_manual_seed(0)


def _actor(hf: Path, seed: int, dtype: torch.dtype = torch.float32) -> dict:
    from rl_megatron.config import OptimConfig
    from rl_megatron.models.builders import build_gpt_chunks
    from rl_megatron.models.hf_config import load_hf_config
    from rl_megatron.trainer.roles import MegatronRole

    torch.manual_seed(seed)
    chunks = build_gpt_chunks(load_hf_config(hf), ParallelLayout.from_megatron(), dtype=dtype)
    return {"actor": MegatronRole(chunks, optim=OptimConfig(lr=1e-2), micro_batch_size=2)}


def _refused(manager, path: Path, roles: dict, *needles: str, **kwargs) -> str:
    """The load's CheckpointError: one short line holding the path and every needle."""
    from rl_megatron.checkpoint.training_state import CheckpointError

    with pytest.raises(CheckpointError) as info:
        manager.load(path, roles, **kwargs)
    message = str(info.value)
    assert "\n" not in message and len(message) < 700, message
    for needle in (str(path / "actor"), *needles):
        assert needle in message, f"'{needle}' not in: {message}"
    return message


def _older_copy(path: Path, name: str, drop_sidecar: bool = False) -> Path:
    """A copy of `path` whose record has no vpp / ep / etp / sequence_parallel / dtype (as
    saved before they were recorded); rank 0 writes it."""
    import torch.distributed as dist

    from rl_megatron.checkpoint import integrity

    old = path.parent / name
    if dist.get_rank() == 0:
        shutil.copytree(path, old)
        meta = json.loads((old / "trainer_state.json").read_text())
        for key in ("vpp", "ep", "etp", "sequence_parallel"):
            del meta["layout"][key]
        del meta["roles"]["actor"]["dtype"]
        (old / "trainer_state.json").write_text(json.dumps(integrity.seal(meta)))
        if drop_sidecar:
            (old / "actor" / "rl_megatron.json").unlink()
    dist.barrier()
    return old


def _body(rank: int, world_size: int, root: Path, hf: Path) -> None:
    from rl_megatron.checkpoint.training_state import CheckpointManager

    _init(ep=2)
    roles = _actor(hf, seed=0)
    rows = {k: v[rank * 2 : (rank + 1) * 2] for k, v in tts._batch().items()}
    roles["actor"].train_step(rows, tts._actor_loss)
    saved = tts._snapshot(roles)
    manager = CheckpointManager(root / "run")
    sidecar = {"format_version": 1, "head": "lm", "dtype": "fp32", "padded_vocab_size": 128}
    path = manager.save(1, roles, {}, sidecar={"actor": sidecar})

    # The record: every degree, and the role's dtype.
    meta = json.loads((path / "trainer_state.json").read_text())
    assert meta["layout"] == {
        "world_size": 2, "tp": 1, "pp": 1, "vpp": None, "dp": 2, "cp": 1, "ep": 2, "etp": 1,
        "sequence_parallel": False,
    }  # fmt: skip
    assert meta["roles"]["actor"]["dtype"] == "fp32"
    older = _older_copy(path, "older")
    no_sidecar = _older_copy(path, "no_sidecar", drop_sidecar=True)

    # Same settings: the record and an older one both resume bit for bit.
    for source in (path, older):
        fresh = _actor(hf, seed=1)
        assert manager.load(source, fresh) == (1, {})
        tts._assert_same(f"resumed from {source.name}", saved, tts._snapshot(fresh))

    # model.dtype: from the record, else from the sidecar, else the KeyError safety net.
    bf16 = _actor(hf, seed=1, dtype=torch.bfloat16)
    for source in (path, older):
        _refused(manager, source, bf16, "model.dtype=fp32", "model.dtype=bf16", "resume with")
    line = _refused(manager, no_sidecar, bf16, "model.dtype=bf16", verify=False)
    assert "KeyError" not in line and "parallel.ep" in line, line

    # parallel.ep: refused before any load, allow_reshard or not.
    _init(ep=1)
    moved = _actor(hf, seed=1)
    for allow in (False, True):
        line = _refused(manager, path, moved, "parallel.ep=2", "parallel.ep=1", allow_reshard=allow)
        assert "resume at parallel.ep=2" in line, line
    # An older record cannot tell: megatron-core's KeyError, as one line naming the keys.
    line = _refused(manager, older, moved, "parallel.ep", "model.dtype", allow_reshard=True)
    assert "parallel.ep=1" in line and "[" not in line and "(cut;" not in line, line


@pytest.mark.slow
def test_resume_refusals(tmp_path):
    """The module docstring's cases, in one 2-rank run."""
    hf = _write_moe_config(tmp_path / "hf")
    run_on_ranks(_body, world_size=2, root=tmp_path, hf=hf)


@pytest.mark.slow
def test_launcher_resume_at_another_ep_or_dtype_is_one_line(tmp_path):
    """launch/ppo.py as users run it: a tiny MoE GRPO run saved at parallel.ep=2 (1 step, 2
    ranks), rerun in the same folder at ep=1, then at model.dtype=bf16: exit 2 and exactly
    one line on stderr naming the key, what was saved and what is asked."""
    from tests.e2e.test_launcher import _launch, _run

    common = ["--config", "yaml_configs/tiny_moe_cpu.yaml", f"trainer.output_dir={tmp_path}"]
    common += ["trainer.total_steps=1", "trainer.val_interval=0"]
    first = _run([*common, "parallel.ep=2"], torchrun_ranks=2, timeout=300)
    assert first.returncode == 0, first.stderr[-3000:]
    actor = tmp_path / "tiny_moe_cpu" / "checkpoints" / "step_00000001" / "actor"
    cases = {
        "parallel.ep=1": f"error: {actor}: saved at parallel.ep=2, this run has parallel.ep=1: "
        "megatron-core cannot load the experts' optimizer state at another expert layout, "
        "even with checkpoint.allow_reshard; resume at parallel.ep=2",
        "model.dtype=bf16": f"error: {actor}: saved with model.dtype=fp32, this run has "
        "model.dtype=bf16: the training state resumes only at the dtype it was saved at; "
        "resume with model.dtype=fp32 (or export it with checkpoints_tools/megatron_to_hf.py "
        "and start a new run from that)",
    }
    for override, expected in cases.items():
        ep = [] if override.startswith("parallel.ep") else ["parallel.ep=2"]
        # Through rl-megatron-run, which keeps the rank's line and exit code (plain torchrun
        # would add its ChildFailedError report and exit 1).
        result = _launch(["--nproc_per_node", "2"], "launch/ppo.py", *common, *ep, override)
        assert result.returncode == 2, result.stderr[-3000:]
        assert result.stderr.strip().splitlines() == [expected], result.stderr[-3000:]
