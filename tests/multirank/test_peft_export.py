"""The LoRA actor's adapters in the HF PEFT layout (`checkpoint/peft_export.py`).

One 2-rank spawn builds the tiny GQA Llama of test_roles (4 layers, 4 query heads in 2
groups, fp32) with adapters on linear_qkv, linear_proj, linear_fc1, linear_fc2 and the
untied LM head (test_lora's MODULES; PEFT's `lm_head`, B without its padding rows), B
perturbed to the same full tensor in every layout (test_lora's `_perturb_b`), at TP1·DP2,
TP2 and PP2, and in each writes the adapter folder (`save_peft_adapter`). At TP1 it also
writes the merged HF export (`save_hf_checkpoint`) and keeps the actor's log-probs and
entropies of test_roles' batch. Then, in the test process:

  (a) the TP2 and PP2 folders equal TP1's byte for byte, both files (the split factor is
      gathered, not recomputed: any layout bug changes bytes);
  (b) the file holds exactly PEFT's names and shapes for the model (q/k/v, gate/up split);
      each q/k/v_proj and gate/up_proj lora_A is the fused adapter's A;
  (c) `PeftModel.from_pretrained` onto the model's own HF folder (the frozen base) loads
      every tensor (PEFT's state dict equals the file) and its r / lora_alpha;
  (d) its logits equal the merged export's within 2e-5 absolute (fp32; the merged weight
      rounds W + s·B·A once, PEFT adds s·B(A x) to W x: summation order only, 4e-6 seen),
      and the adapter moved them (> 1e-2 from the base's);
  (e) its response log-probs (temperature 0.7) and entropies equal the Megatron LoRA
      actor's within 1e-4 (test_roles' HF-vs-Megatron parity bound).

`test_peft_export_of_experts` does (d) for Qwen3-MoE and Mixtral with every expert adapted;
`test_trainer_writes_the_adapter_beside_the_merged_model` checks the trainer's
`checkpoint.save_hf_adapter` folder the same way, and that `megatron_to_hf.py` on the same
step's checkpoint writes it again (`--adapter-only`) and the merged folder (without).
"""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

from rl_megatron.parallel import MEGATRON_RANK_ORDER
from tests.multirank.test_lora import ALPHA, MODULES, RANK, _actor, _perturb_b
from tests.multirank.test_roles import TEMPERATURE, P, R, _make_checkpoint
from tests.spawn import require_ranks, run_on_ranks

LAYOUTS = [(1, 1), (2, 1), (1, 2)]
LOGIT_TOL, PARITY_TOL = 2e-5, 1e-4


def _body(rank, world_size, root):
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from rl_megatron.checkpoint.hf_export import save_hf_checkpoint
    from rl_megatron.checkpoint.peft_export import save_peft_adapter
    from rl_megatron.config import LoraConfig
    from rl_megatron.models.hf_config import load_hf_config

    info = load_hf_config(root / "llama")
    lora = LoraConfig(rank=RANK, alpha=ALPHA, dropout=0.0, target_modules=MODULES)
    batch = torch.load(root / "batch.pt")
    batch.pop("ref_grad_norm")  # a scalar, not a row per sequence
    for tp, pp in LAYOUTS:
        ps.destroy_model_parallel()
        ps.initialize_model_parallel(tp, pp, order=MEGATRON_RANK_ORDER)
        model_parallel_cuda_manual_seed(0)
        actor = _actor(root, lora=True)
        _perturb_b(actor, tp, ps.get_tensor_model_parallel_rank())
        out = root / f"peft_tp{tp}pp{pp}"
        save_peft_adapter(
            actor.model,
            info,
            out,
            actor.groups,
            lora=lora,
            base_model_name_or_path=str(root / "llama"),
        )
        if (tp, pp) == (1, 1):
            save_hf_checkpoint(
                actor.model, info, root / "merged", actor.groups, src_dir=root / "llama"
            )
            got = actor.forward_only(batch, with_entropy=True)
            if rank == 0:
                torch.save(got, root / "megatron.pt")
    ps.destroy_model_parallel()


def _hf_logits(model, batch) -> torch.Tensor:
    ids = torch.cat([batch["prompts"], batch["responses"]], dim=1)
    with torch.no_grad():
        return model(
            ids, attention_mask=batch["attention_mask"], position_ids=batch["position_ids"]
        ).logits


def test_peft_export(tmp_path):
    from peft import PeftModel
    from peft.utils import get_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    require_ranks(2)
    _make_checkpoint(tmp_path)
    run_on_ranks(_body, world_size=2, root=tmp_path)
    ref = tmp_path / "peft_tp1pp1"
    # (a) every layout writes the same bytes.
    for tp, pp in LAYOUTS[1:]:
        for name in ("adapter_config.json", "adapter_model.safetensors"):
            got = (tmp_path / f"peft_tp{tp}pp{pp}" / name).read_bytes()
            assert got == (ref / name).read_bytes(), f"tp{tp}pp{pp}: {name} differs from TP1's"
    # (b) PEFT's names and shapes for this model.
    tensors = load_file(ref / "adapter_model.safetensors")
    h, q, kv, f = 64, 64, 32, 96  # hidden, 4 heads × 16, 2 groups × 16, intermediate
    shapes = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
              "gate_proj": (h, f), "up_proj": (h, f), "down_proj": (f, h)}  # fmt: skip
    want = {}
    for layer in range(4):
        for proj, (n_in, n_out) in shapes.items():
            part = "self_attn" if proj in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            stem = f"base_model.model.model.layers.{layer}.{part}.{proj}"
            want[f"{stem}.lora_A.weight"] = (RANK, n_in)
            want[f"{stem}.lora_B.weight"] = (n_out, RANK)
    # The LM head's adapter (test_lora adapts `output_layer`): B without the vocabulary padding.
    want["base_model.model.lm_head.lora_A.weight"] = (RANK, h)
    want["base_model.model.lm_head.lora_B.weight"] = (100, RANK)
    assert {k: tuple(v.shape) for k, v in tensors.items()} == want
    for layer in range(4):
        stem = f"base_model.model.model.layers.{layer}."
        for group in (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")):
            part = "self_attn." if "q_proj" in group else "mlp."
            a = [tensors[f"{stem}{part}{p}.lora_A.weight"] for p in group]
            assert all(torch.equal(a[0], x) for x in a[1:]), f"layer {layer}: {group} A differ"
    config = json.loads((ref / "adapter_config.json").read_text())
    assert config["r"] == RANK and config["lora_alpha"] == ALPHA and config["peft_type"] == "LORA"
    assert sorted(config["target_modules"]) == sorted([*shapes, "lm_head"])
    assert config["base_model_name_or_path"] == str(tmp_path / "llama")
    # (c) PEFT loads every tensor onto the base (the model's own HF folder).
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "llama", dtype=torch.float32).eval()
    batch = torch.load(tmp_path / "batch.pt")
    base_logits = _hf_logits(base, batch)
    model = PeftModel.from_pretrained(base, ref).eval()
    assert model.peft_config["default"].r == RANK
    assert model.peft_config["default"].lora_alpha == ALPHA
    # (PEFT would save the head's base weight too, guessing a resized vocabulary: not asked.)
    loaded = get_peft_model_state_dict(model, save_embedding_layers=False)
    assert loaded.keys() == tensors.keys()
    for key, value in tensors.items():
        assert torch.equal(loaded[key], value), f"PEFT holds another {key}"
    # (d) the adapted logits are the merged export's, and not the base's.
    logits = _hf_logits(model, batch)
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)
    err = (logits - _hf_logits(merged.eval(), batch)).abs().max().item()
    assert err < LOGIT_TOL, f"PEFT vs merged export: logits differ by {err:.2e}"
    moved = (logits - base_logits).abs().max().item()
    assert moved > 1e-2, f"the adapter moved the logits by {moved:.2e} only"
    # (e) ... and the Megatron LoRA actor's log-probs and entropies.
    logp = torch.log_softmax(logits[:, P - 1 : P - 1 + R] / TEMPERATURE, dim=-1)
    lp = logp.gather(-1, batch["responses"].unsqueeze(-1)).squeeze(-1)
    ent = -(logp.exp() * logp).sum(-1)
    megatron = torch.load(tmp_path / "megatron.pt")
    mask = batch["response_mask"].bool()
    for key, mine in (("log_prob", lp), ("entropy", ent)):
        err = (mine - megatron[key])[mask].abs().max().item()
        assert err < PARITY_TOL, f"PEFT vs Megatron {key}: {err:.2e}"


# ----------------------------------------------------------------- the trainer's wiring

TINY = Path(__file__).resolve().parents[2] / "yaml_configs" / "tiny_cpu.yaml"
TRAINER_OVERRIDES = [
    "actor.lora.rank=4",
    "actor.lora.alpha=8",
    "checkpoint.save_hf=true",
    "checkpoint.save_hf_adapter=true",
    "trainer.total_steps=1",
    "trainer.val_interval=0",
]


def _train_and_save(rank, world_size, tmp_path):
    from rl_megatron.checkpoint.hf_export import save_hf_checkpoint
    from rl_megatron.config import load_config
    from rl_megatron.distributed import distributed_run
    from rl_megatron.models.lora import adapters_of
    from rl_megatron.parallel import ParallelLayout
    from rl_megatron.trainer.ppo_trainer import build_trainer

    config = load_config(TINY, [f"trainer.output_dir={tmp_path}", *TRAINER_OVERRIDES])
    with distributed_run(
        ParallelLayout.from_config(config.parallel, world_size), seed=config.trainer.seed
    ) as run:
        trainer = build_trainer(config, run, logging.getLogger("test"))
        trainer.train_step()
        trainer.step = 1
        trainer.save()  # the checkpoint, hf/step_00000001 and hf_adapter/step_00000001
        # The frozen base as an HF folder: the export with every B zeroed (W + s·0·A = W).
        snapshots, model = trainer.hf_snapshots, trainer.roles.actor.model
        adapters = adapters_of(model)
        kept = [a.lora_b.detach().clone() for a in adapters]
        with torch.no_grad():
            for a in adapters:
                a.lora_b.zero_()
            save_hf_checkpoint(
                model, snapshots.info, tmp_path / "base", snapshots.groups, src_dir=snapshots.source
            )
            for a, b in zip(adapters, kept):
                a.lora_b.copy_(b)


def test_trainer_writes_the_adapter_beside_the_merged_model(tmp_path):
    """`checkpoint.save_hf_adapter` with `checkpoint.save_hf` (tiny_cpu.yaml at TP2, LoRA
    r=4 on every module, one PPO step so B is no longer zero): `save()` writes
    `hf_adapter/step_00000001`, whose adapter_config names the run's r / alpha, and which,
    loaded by PEFT onto the base (the export with B zeroed), gives the logits of the merged
    folder `hf/step_00000001` within 2e-5 (fp32, as in test_peft_export)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    require_ranks(2)
    run_on_ranks(_train_and_save, world_size=2, tmp_path=tmp_path)
    run = tmp_path / "tiny_cpu"
    adapter = run / "hf_adapter" / "step_00000001"
    assert sorted(p.name for p in adapter.iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["base_model_name_or_path"]) == (4, 8, None)
    b = [t for k, t in load_file(adapter / "adapter_model.safetensors").items() if "lora_B" in k]
    assert b and all(t.abs().max() > 0 for t in b), "a B is still zero after a step"
    ids = torch.randint(3, 20, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        base = AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32)
        base_logits = base.eval()(ids).logits
        adapted = PeftModel.from_pretrained(base, adapter).eval()(ids).logits
        merged_dir = run / "hf" / "step_00000001"
        merged = AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32)
        merged_logits = merged.eval()(ids).logits
    err = (adapted - merged_logits).abs().max().item()
    moved = (merged_logits - base_logits).abs().max().item()
    assert err < LOGIT_TOL, f"PEFT adapter vs merged folder: logits differ by {err:.2e}"
    assert moved > 10 * LOGIT_TOL, f"one step moved the logits by {moved:.2e} only"
    _check_tool(tmp_path, run, adapter, merged_dir)


def _check_tool(tmp_path, run, adapter, merged_dir):
    """megatron_to_hf.py on the same step's actor checkpoint: `--adapter-only` writes the
    trainer's PEFT folder byte for byte, and without it the adapters are merged: the
    trainer's merged folder, tensor for tensor (bitwise: the same fp32 ops on the same rows).
    The random init has no HF source, so the checkpoint's `hf/` (config.json only) is added
    to a copy here, and the copy's manifest not checked (--no-verify)."""
    ckpt = tmp_path / "step" / "actor"
    shutil.copytree(run / "checkpoints" / "step_00000001" / "actor", ckpt)
    # The step folder holds the adapters only; the tool reads the weights from the run's
    # base copy, which the step folder names as `../lora_base/actor`.
    shutil.copytree(run / "checkpoints" / "lora_base", tmp_path / "lora_base")
    (ckpt / "hf").mkdir()
    shutil.copy(run / "hf" / ".source" / "config.json", ckpt / "hf" / "config.json")
    _run_tool(ckpt, tmp_path / "tool_adapter", "--no-verify", "--adapter-only")
    _run_tool(ckpt, tmp_path / "tool_merged", "--no-verify")
    _same_folders(tmp_path / "tool_adapter", adapter)
    _same_tensors(tmp_path / "tool_merged", merged_dir)


def _run_tool(ckpt: Path, out: Path, *extra: str) -> None:
    tool = Path(__file__).resolve().parents[2] / "checkpoints_tools" / "megatron_to_hf.py"
    cmd = [sys.executable, str(tool), "--ckpt", str(ckpt), "--out", str(out), *extra]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]


def _same_folders(mine: Path, theirs: Path) -> None:
    """Two PEFT folders, byte for byte."""
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        assert (mine / name).read_bytes() == (theirs / name).read_bytes(), f"{mine}: {name}"


def _same_tensors(mine: Path, theirs: Path) -> None:
    """Two HF folders' tensors, bitwise (the same fp32 merge of the same rows)."""
    got, want = load_file(mine / "model.safetensors"), load_file(theirs / "model.safetensors")
    assert got.keys() == want.keys(), mine
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), f"{mine}: {name} differs"


# ----------------------------------------------------------------------------- experts

MOE_MODELS = ("qwen3_moe", "mixtral")


def _moe_body(rank, world_size, root):
    import zlib

    from rl_megatron.checkpoint.hf_builders import build_actor
    from rl_megatron.checkpoint.hf_export import save_hf_checkpoint
    from rl_megatron.checkpoint.peft_export import save_peft_adapter
    from rl_megatron.config import LoraConfig
    from rl_megatron.models.hf_config import load_hf_config
    from rl_megatron.models.lora import apply_lora
    from rl_megatron.parallel import ParallelGroups, ParallelLayout
    from tests.multirank import test_moe as tm

    lora = LoraConfig(rank=RANK, alpha=ALPHA, dropout=0.0, target_modules=MODULES)
    tm._init(1, 1, 1, 1)
    for name in MOE_MODELS:
        layout = ParallelLayout.from_megatron()
        chunks = build_actor(root / name, layout, dtype=torch.float32)
        adapters = apply_lora(chunks, **vars(lora), seed=0)
        with torch.no_grad():
            for i, a in enumerate(adapters):
                gen = torch.Generator().manual_seed(zlib.crc32(f"{name}{i}".encode()))
                a.lora_b.copy_(0.05 * torch.randn(a.lora_b.shape, generator=gen))
        info, groups = load_hf_config(root / name), ParallelGroups.from_megatron(layout)
        save_peft_adapter(
            chunks, info, root / f"peft_{name}", groups, lora=lora, base_model_name_or_path=None
        )
        save_hf_checkpoint(chunks, info, root / f"merged_{name}", groups, src_dir=root / name)
        # The same actor as a Megatron checkpoint, with the sidecars the tools read.
        from megatron.core import dist_checkpointing

        ckpt = root / f"ckpt_{name}"
        ckpt.mkdir()
        dist_checkpointing.save({"model": chunks[0].sharded_state_dict()}, str(ckpt))
        meta = {"format_version": 1, "head": "lm", "dtype": "float32", "source": None,
                "padded_vocab_size": chunks[0].embedding.word_embeddings.weight.shape[0],
                "lora": {"rank": RANK, "alpha": ALPHA, "dropout": 0.0}}  # fmt: skip
        (ckpt / "rl_megatron.json").write_text(json.dumps(meta))
        (ckpt / "hf").mkdir()
        shutil.copy(root / name / "config.json", ckpt / "hf" / "config.json")


def test_peft_export_of_experts(tmp_path):
    """Qwen3-MoE and Mixtral (test_moe's tiny models) with adapters on attention and every
    expert's fc1 / fc2, B perturbed: the PEFT folder names each expert's projections
    (`mlp.experts.{e}.gate_proj`, `block_sparse_moe.experts.{e}.w1`), and PEFT, converting
    them on load into its adapter of transformers 5's fused expert parameters, gives the
    merged export's logits (2e-5). The same actor saved with dist_checkpointing (experts
    stacked [layers, E, ...]) gives megatron_to_hf.py's --adapter-only folder, byte for
    byte, and its merged folder, bitwise."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from tests.multirank import test_moe as tm

    tm._make_checkpoints(tmp_path)
    run_on_ranks(_moe_body, world_size=1, root=tmp_path)
    ids = torch.load(tmp_path / "refs.pt")["ids"]
    for name in MOE_MODELS:
        names = load_file(tmp_path / f"peft_{name}" / "adapter_model.safetensors").keys()
        expert = (
            "mlp.experts.3.gate_proj" if name == "qwen3_moe" else "block_sparse_moe.experts.3.w1"
        )
        assert f"base_model.model.model.layers.1.{expert}.lora_B.weight" in names, name
        with torch.no_grad():
            base = AutoModelForCausalLM.from_pretrained(tmp_path / name, dtype=torch.float32)
            base_logits = base.eval()(ids).logits
            model = PeftModel.from_pretrained(base, tmp_path / f"peft_{name}").eval()
            logits = model(ids).logits
            merged = AutoModelForCausalLM.from_pretrained(
                tmp_path / f"merged_{name}", dtype=torch.float32
            )
            merged_logits = merged.eval()(ids).logits
        err = (logits - merged_logits).abs().max().item()
        moved = (merged_logits - base_logits).abs().max().item()
        assert err < LOGIT_TOL, f"{name}: PEFT vs merged export: logits differ by {err:.2e}"
        assert moved > 1e-2, f"{name}: the adapter moved the logits by {moved:.2e} only"
        # megatron_to_hf.py reads the experts' adapters from the stacked checkpoint too.
        ckpt = tmp_path / f"ckpt_{name}"  # saved without a manifest: --no-verify
        _run_tool(ckpt, tmp_path / f"tool_adapter_{name}", "--no-verify", "--adapter-only")
        _run_tool(ckpt, tmp_path / f"tool_merged_{name}", "--no-verify")
        _same_folders(tmp_path / f"tool_adapter_{name}", tmp_path / f"peft_{name}")
        _same_tensors(tmp_path / f"tool_merged_{name}", tmp_path / f"merged_{name}")
