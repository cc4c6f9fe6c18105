"""The conversion CLIs end to end, as users run them (subprocesses, torchrun on gloo ranks).

* A tiny bf16 Llama (GQA, sharded safetensors with an index, a tokenizer with a chat
  template) goes HF → Megatron at TP2·PP2·VPP2 (torchrun, 4 processes, each writing its own
  shard) → HF (torchrun, 2 processes, each writing its own safetensors shards: the shard
  size is set small so that both write). The result is bit-identical tensor by tensor (same
  names, dtypes, values), carries config / generation config / tokenizer, loads with
  `from_pretrained` and generates the same greedy tokens as the source.
* A tiny bf16 Qwen3 (QK-norm with norms away from 1, head_dim 32 ≠ hidden/heads, tied
  embeddings) converted at TP2·PP2 by one process (the streaming path that builds no model
  at all) loads into Megatron model chunks at another layout (TP2·PP1) exactly as the
  trainer loads checkpoints (every key, strict), equal to loading the HF weights directly,
  and exports back bit-identically from one process.
* Bad input — no config.json, a truncated safetensors shard, TP that does not divide the KV
  heads, a tokenizer larger than the embedding, an existing non-empty output, an HF directory
  given to the export as a Megatron checkpoint — exits with code 2 and one line on stderr naming the file or field, and leaves no output behind.

Tolerance: none; the round trip must be exact (bf16 in, bf16 out, no arithmetic).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rl_megatron.parallel import MEGATRON_RANK_ORDER, ParallelLayout
from tests.spawn import run_on_ranks

ROOT = Path(__file__).resolve().parents[2]
TOOLS = ROOT / "checkpoints_tools"
V = 100


def _make_hf(path: Path, tokenizer_size: int = 96, family: str = "llama") -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast, Qwen3Config

    common = dict(
        vocab_size=V,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    if family == "qwen3":
        cfg = Qwen3Config(**common, head_dim=32, tie_word_embeddings=True)
    else:
        cfg = LlamaConfig(**common)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    with torch.no_grad():  # norms away from 1 so that a dropped norm would show
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn(p.shape, dtype=p.dtype))
    # Small shards: the loader must follow model.safetensors.index.json.
    model.save_pretrained(path, safe_serialization=True, max_shard_size="60KB")
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3}
    vocab.update({f"w{i}": i for i in range(4, tokenizer_size)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
    )
    fast.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    fast.save_pretrained(path)


def _env() -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    env.pop("CUDA_VISIBLE_DEVICES", None)
    return env


def _tool(name: str, *args, nproc: int = 1) -> subprocess.Popen:
    cmd = [sys.executable]
    if nproc > 1:
        cmd += ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    cmd += [str(TOOLS / name), *map(str, args)]
    return subprocess.Popen(
        cmd, cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def _finish(proc: subprocess.Popen, timeout: int = 300) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for f in sorted(path.glob("*.safetensors")):
        tensors.update(load_file(f))
    return tensors


def _bad_inputs(tmp: Path, good: Path) -> list[tuple[str, Path, subprocess.Popen]]:
    """Start every bad-input run at once (they fail before importing megatron)."""
    (tmp / "empty").mkdir()
    truncated = tmp / "truncated"
    shutil.copytree(good, truncated)
    shard = sorted(truncated.glob("model-*.safetensors"))[1]
    shard.write_bytes(shard.read_bytes()[:-100])
    big_tok = tmp / "big_tokenizer"
    _make_hf(big_tok, tokenizer_size=120)
    nonempty = tmp / "nonempty"
    nonempty.mkdir()
    (nonempty / "keep.txt").write_text("user data")
    cases = [
        ("config.json", tmp / "empty", tmp / "o1", ["--tp", "1"]),
        (f"{shard.name}: truncated", truncated, tmp / "o2", ["--tp", "1"]),
        ("num_key_value_heads=2 is not divisible by tp=4", good, tmp / "o3", ["--tp", "4"]),
        ("tokenizer has 120 tokens but config.json vocab_size=100", big_tok, tmp / "o4", []),
        ("exists and is not empty", good, nonempty, []),
    ]
    runs = [
        (expect, out, _tool("hf_to_megatron.py", "--hf-dir", src, "--out", out, *extra))
        for expect, src, out, extra in cases
    ]
    # An HF directory is not a Megatron checkpoint.
    export = _tool("megatron_to_hf.py", "--ckpt", good, "--out", tmp / "o5")
    return [*runs, ("rl_megatron.json: not found", tmp / "o5", export)]


def _load_into_model(rank: int, world_size: int, hf_dir: Path, ckpt: Path) -> None:
    """Load `ckpt` as the trainer does (strict, every key) at TP2·PP1; compare with HF."""
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from rl_megatron.checkpoint.hf_loader import load_hf_weights
    from rl_megatron.models.builders import build_gpt_chunks
    from rl_megatron.models.hf_config import load_hf_config

    ps.initialize_model_parallel(2, 1, order=MEGATRON_RANK_ORDER)
    model_parallel_cuda_manual_seed(0)
    info = load_hf_config(hf_dir)
    from_ckpt, from_hf = (
        build_gpt_chunks(
            info, ParallelLayout.from_megatron(), padded_vocab=256, perform_initialization=False
        )[0]
        for _ in range(2)
    )
    state = {"model": from_ckpt.sharded_state_dict()}
    loaded = dist_checkpointing.load(state, str(ckpt), strict="raise_all")
    from_ckpt.load_state_dict(loaded["model"], strict=True)
    load_hf_weights([from_hf], hf_dir, info, ParallelLayout.from_megatron())
    expected = dict(from_hf.named_parameters())
    for name, param in from_ckpt.named_parameters():
        assert torch.equal(param, expected[name]), f"rank {rank}: {name} differs"


def _check_same(src: Path, out: Path) -> None:
    a, b = _tensors(src), _tensors(out)
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype == torch.bfloat16, name
        assert torch.equal(a[name], b[name]), f"{out}: {name} is not bit-identical"
    for name in (
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
    ):
        assert (out / name).is_file(), name


@pytest.mark.slow
def test_hf_megatron_hf_round_trip_and_bad_inputs(tmp_path):
    src, meg, out = tmp_path / "hf", tmp_path / "meg", tmp_path / "hf_out"
    src1, meg1, out1 = tmp_path / "hf_qwen3", tmp_path / "meg_1proc", tmp_path / "hf_out_1proc"
    _make_hf(src)
    _make_hf(src1, family="qwen3")
    layout = ["--tp", 2, "--pp", 2, "--dtype", "bf16"]
    to_meg = _tool("hf_to_megatron.py", "--hf-dir", src, "--out", meg, *layout, "--vpp", 2, nproc=4)
    code, stdout, stderr = _finish(to_meg)
    assert code == 0, stderr[-3000:]
    assert "padded vocab 256" in stdout
    assert json.loads((meg / "rl_megatron.json").read_text())["padded_vocab_size"] == 256

    # Bad inputs run while the other conversions run: all quick, before any heavy import.
    bad = _bad_inputs(tmp_path, src)
    code, _, stderr = _finish(_tool("hf_to_megatron.py", "--hf-dir", src1, "--out", meg1, *layout))
    assert code == 0, stderr[-3000:]
    # ~52 KB shards: both processes write some (the model is ~270 KB).
    shard_gb = ["--max-shard-gb", 0.00005]
    code, stdout, stderr = _finish(
        _tool("megatron_to_hf.py", "--ckpt", meg, "--out", out, *shard_gb, nproc=2)
    )
    assert code == 0, stderr[-3000:]
    assert (out / "model.safetensors.index.json").is_file() and "6 shards" in stdout
    for expect, out_dir, proc in bad:
        code, _, stderr = _finish(proc)
        lines = stderr.strip().splitlines()
        assert code == 2, f"{expect}: exit code {code}\n{stderr[-2000:]}"
        assert len(lines) == 1 and expect in lines[0], f"{expect}: stderr was\n{stderr}"
        assert not (out_dir.parent / f".{out_dir.name}.partial").exists()
        if out_dir.name != "nonempty":
            assert not out_dir.exists(), f"{expect}: left {out_dir} behind"
    assert (tmp_path / "nonempty" / "keep.txt").read_text() == "user data"
    _check_same(src, out)

    code, _, stderr = _finish(_tool("megatron_to_hf.py", "--ckpt", meg1, "--out", out1))
    assert code == 0, stderr[-3000:]
    _check_same(src1, out1)
    run_on_ranks(_load_into_model, world_size=2, hf_dir=src1, ckpt=meg1)
    assert not list(tmp_path.glob(".*.partial"))

    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(out)
    prompt = tok.apply_chat_template([{"role": "user", "content": "w5 w6 w7"}], tokenize=False)
    ids = tok(prompt, return_tensors="pt").input_ids
    outputs = []
    for path in (src, out):
        model = AutoModelForCausalLM.from_pretrained(path).eval()
        outputs.append(model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0))
    assert torch.equal(outputs[0], outputs[1]), outputs
