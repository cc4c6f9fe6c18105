"""torchrun body of tests/vllm/test_vllm_lora_sync.py: a LoRA actor's merged weights into vLLM.

    python -m torch.distributed.run --nproc_per_node 2 tests/vllm/lora_sync_script.py \
        --spec spec.json --out outdir

One vLLM engine (CPU build, rollout TP 2) loads the tiny Llama itself. The CPU build packs
its linear weights for oneDNN after loading and empties `weight` (`rollout/vllm/repacked.py`),
so nothing could read them back: this script turns vLLM's oneDNN dispatch off before the
engine is built, so each linear layer keeps its checkpoint-format weight and computes with
it (vLLM's own `torch.nn.functional.linear` fallback). The sync still goes through the
layerwise reload, as on any CPU build.

The expectation never touches the trainer's code: the adapters' full tensors are drawn here
per global name (A and B on a dyadic grid, so B·A, the scale 2 and the one rounding of W +
scale·B·A are exact whatever the order of the products or the shard sizes), merged by hand
into the HF checkpoint's tensors (q/k/v rows taken out of Megatron's per-group interleave by
hand), and loaded by vLLM itself (`update_weights`): what it then holds is what the sync
must produce, bit for bit. For each training layout (TP 2, and PP 2, whose layers cross
ranks), a Megatron actor with adapters on all four linear kinds and the LM head is synced
with B from one draw, then again after B changed; every engine parameter is read back from
vLLM's model and compared. `rollout.verify_sync=full` runs on each sync with the engine read
in full (the linear weights are readable here). Each rank writes `outdir/rank{r}.json`.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import traceback
import zlib
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import load_file

RANK, ALPHA = 4, 8.0  # scale alpha / rank = 2: exact
MODULES = ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2", "output_layer"]


def dyadic(shape: tuple[int, ...], std: float, grid: int, seed: int) -> torch.Tensor:
    """Normal draws rounded to multiples of 1/grid (few significant bits: exact products)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.round(std * grid * torch.randn(shape, generator=gen)) / grid


def full_adapters(config, draw: int) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    """(layer, module) → (A [r, in], B [out, r]) in full. linear_qkv's B rows in Megatron's
    order (per query group: its q heads, k, v); linear_fc1's as [gate; up]; the LM head's
    (layer -1) one row per token of the HF vocabulary (Megatron's padding rows get B = 0)."""
    hidden, ffn, hd = config.hidden_size, config.intermediate_size, config.head_dim
    heads, groups = config.num_attention_heads, config.num_key_value_heads
    shapes = {
        "linear_qkv": (hidden, (heads + 2 * groups) * hd),
        "linear_proj": (heads * hd, hidden),
        "linear_fc1": (hidden, 2 * ffn),
        "linear_fc2": (ffn, hidden),
    }
    out = {}
    for layer in range(config.num_hidden_layers):
        for module, (n_in, n_out) in shapes.items():
            seed = zlib.crc32(f"{layer}.{module}".encode())
            a = dyadic((RANK, n_in), 0.1, 64, seed)
            b = dyadic((n_out, RANK), 0.05, 256, seed + 1000 * draw)
            out[layer, module] = (a, b)
    seed = zlib.crc32(b"output_layer")
    a = dyadic((RANK, hidden), 0.1, 64, seed)
    out[-1, "output_layer"] = (a, dyadic((config.vocab_size, RANK), 0.05, 256, seed + 1000 * draw))
    return out


def hand_merged(base: dict[str, torch.Tensor], config, adapters) -> dict[str, torch.Tensor]:
    """The HF checkpoint with W + (alpha/r)·B·A in every adapted weight, by hand."""
    hd, groups = config.head_dim, config.num_key_value_heads
    per_group = config.num_attention_heads // groups
    scale = ALPHA / RANK
    out = dict(base)

    def add(name: str, b: torch.Tensor, a: torch.Tensor) -> None:
        out[name] = base[name] + (b @ a) * scale

    for (layer, module), (a, b) in adapters.items():
        pre = f"model.layers.{layer}"
        if module == "output_layer":
            add("lm_head.weight", b, a)
        elif module == "linear_qkv":
            rows = b.reshape(groups, per_group + 2, hd, RANK)
            add(f"{pre}.self_attn.q_proj.weight", rows[:, :per_group].reshape(-1, RANK), a)
            add(f"{pre}.self_attn.k_proj.weight", rows[:, per_group].reshape(-1, RANK), a)
            add(f"{pre}.self_attn.v_proj.weight", rows[:, per_group + 1].reshape(-1, RANK), a)
        elif module == "linear_proj":
            add(f"{pre}.self_attn.o_proj.weight", b, a)
        elif module == "linear_fc1":
            gate, up = b.chunk(2)
            add(f"{pre}.mlp.gate_proj.weight", gate, a)
            add(f"{pre}.mlp.up_proj.weight", up, a)
        else:
            add(f"{pre}.mlp.down_proj.weight", b, a)
    return out


@torch.no_grad()
def set_adapters(actor, adapters, tp: int, tp_rank: int) -> None:
    """Each adapter of `actor` takes its shard of the full tensors (split like its weight)."""
    from rl_megatron.checkpoint.hf_loader import unwrap

    for chunk in actor:
        head = getattr(unwrap(chunk), "output_layer_lora", None)
        if head is not None:  # the last stage: B's padding rows zero, then its TP shard
            a, b = adapters[-1, "output_layer"]
            padded = torch.zeros(head.lora_b.shape[0] * tp, RANK)
            padded[: b.shape[0]] = b
            head.lora_a.copy_(a)
            head.lora_b.copy_(padded.chunk(tp)[tp_rank])
        for layer in unwrap(chunk).decoder.layers:
            i = layer.layer_number - 1
            for module in MODULES[:4]:
                owner = layer.self_attention if module in MODULES[:2] else layer.mlp
                adapter = getattr(owner, module + "_lora")
                a, b = adapters[i, module]
                if adapter.mode == "row":
                    a = a.chunk(tp, dim=1)[tp_rank]
                elif module == "linear_fc1":
                    gate, up = b.chunk(2)
                    b = torch.cat([gate.chunk(tp)[tp_rank], up.chunk(tp)[tp_rank]])
                else:
                    b = b.chunk(tp)[tp_rank]
                adapter.lora_a.copy_(a)
                adapter.lora_b.copy_(b)


def engine_state(engine) -> dict[str, torch.Tensor]:
    from rl_megatron.rollout.vllm.verify import engine_parameters

    return {n: t.detach().clone() for n, t in engine_parameters(engine).items()}


def differing(have: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> list[str]:
    """Names whose tensors differ bitwise (or are missing on one side)."""
    names = sorted(set(have) | set(want))
    return [
        n
        for n in names
        if n not in have
        or n not in want
        or have[n].shape != want[n].shape
        or have[n].dtype != want[n].dtype
        or not torch.equal(have[n].view(torch.int32), want[n].view(torch.int32))
    ]


def rows_of(batch) -> list[dict[str, Any]]:
    rows = []
    for i in range(len(batch)):
        _, response = batch.row_tokens(i)
        rows.append({"response": response, "log_probs": batch.rollout_log_probs[i].tolist()})
    return rows


def run(spec: dict[str, Any]) -> dict[str, Any]:
    import vllm._custom_ops as vllm_ops

    vllm_ops._supports_onednn = False  # linear layers keep a readable weight (docstring)

    from rl_megatron.parallel import ParallelLayout
    from rl_megatron.rollout.sampling import SamplingParams
    from rl_megatron.rollout.vllm.engine import VllmEngine, VllmEngineArgs

    ckpt = spec["ckpt"]
    engine = VllmEngine(
        VllmEngineArgs(
            model=ckpt,
            tp=2,
            dtype="float32",
            max_model_len=128,
            gpu_memory_utilization=0.05,
            seed=0,
        )
    )
    greedy = SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True)
    prompts = spec["prompts"]

    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from transformers import AutoConfig

    from rl_megatron import cpu_compat
    from rl_megatron.checkpoint.hf_builders import build_actor
    from rl_megatron.models.hf_config import load_hf_config
    from rl_megatron.models.lora import apply_lora
    from rl_megatron.resharding.layouts import MEGATRON_RANK_ORDER, TrainingLayout
    from rl_megatron.resharding.verify import SyncVerifier
    from rl_megatron.resharding.weight_sync import WeightSync
    from rl_megatron.rollout.vllm.target import VllmEngineTarget
    from rl_megatron.rollout.vllm.verify import engine_parameters

    cpu_compat.enable_if_no_gpu()
    info = load_hf_config(ckpt)
    hf_config = AutoConfig.from_pretrained(ckpt)
    base_sd = load_file(os.path.join(ckpt, "model.safetensors"))
    res: dict[str, Any] = {"layouts": []}

    # What vLLM holds having loaded the base, and each hand-merged checkpoint, itself.
    base = engine_state(engine)
    drawn = {draw: full_adapters(hf_config, draw) for draw in (1, 2)}
    want, want_rows = {}, {}
    version = 1
    for draw, adapters in drawn.items():
        engine.update_weights(hand_merged(base_sd, hf_config, adapters), version=version)
        want[draw] = engine_state(engine)
        want_rows[draw] = rows_of(engine.generate(prompts, greedy))
        version += 1
    res["changed_by_merge"] = differing(want[1], base)  # adapted weights only
    res["changed_between_draws"] = differing(want[2], want[1])
    res["engine_params"] = sorted(base)

    world = dist.get_world_size()
    for t, p in spec["layouts"]:
        ps.initialize_model_parallel(t, p, order=MEGATRON_RANK_ORDER)
        model_parallel_cuda_manual_seed(0)
        training = TrainingLayout(t, p, world // (t * p))
        actor = build_actor(ckpt, ParallelLayout.from_megatron(), dtype=torch.float32)
        apply_lora(actor, rank=RANK, alpha=ALPHA, dropout=0.0, target_modules=MODULES, seed=0)
        tp_rank = ps.get_tensor_model_parallel_rank()
        case: dict[str, Any] = {"layout": [t, p], "syncs": []}
        # Every engine tensor read back through vLLM, compared with what was sent.
        verifier = SyncVerifier(
            "full",
            interval=1,
            read_engine=functools.partial(engine_parameters, engine, frozenset()),
        )
        engine.weight_sync = WeightSync(
            VllmEngineTarget(engine),
            info=info,
            training=training,
            bucket_mb=spec["bucket_mb"],
            verifier=verifier,
        )
        for draw in (1, 2):
            set_adapters(actor, drawn[draw], t, tp_rank)
            before = {n: q.detach().clone() for c in actor for n, q in c.named_parameters()}
            engine.update_weights(base_sd, version=version)  # stale weights would show
            stats = engine.sync_from(actor, version=version + 1)
            version += 2
            after = {n: q.detach().clone() for c in actor for n, q in c.named_parameters()}
            sync: dict[str, Any] = {
                "draw": draw,
                "mismatched": differing(engine_state(engine), want[draw]),
                "trainer_changed": differing(after, before),
                "trainer_params": len(before),
                "verified_tensors": stats.verify.verified_tensors,
                "unreadable": stats.verify.unreadable,
                "bytes_sent": stats.bytes_sent,
            }
            sync["rows_equal"] = rows_of(engine.generate(prompts, greedy)) == want_rows[draw]
            case["syncs"].append(sync)
        res["layouts"].append(case)
        ps.destroy_model_parallel()
    return res


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--spec", required=True)
    parser.add_argument("--out", required=True)
    cli = parser.parse_args()
    spec = json.loads(Path(cli.spec).read_text())
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    try:
        res = run(spec)
    except Exception:
        res = {"error": traceback.format_exc()}
    Path(cli.out, f"rank{rank}.json").write_text(json.dumps(res))
    # No teardown: deleting the LLM would destroy the default group (see vllm_engine.py).
    os._exit(0 if "error" not in res else 1)


if __name__ == "__main__":
    main()
