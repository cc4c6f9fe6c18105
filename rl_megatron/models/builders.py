"""Megatron `GPTModel` chunks for an HF architecture, in the current parallel layout.

`build_gpt_chunks(info, layout, ...)` builds one chunk per virtual pipeline stage of this
rank (a list of length 1 without VPP), randomly initialised or left for a loader to fill:

* a causal LM (`GPTModel`, vocabulary-parallel output layer: actor, reference),
* or the same trunk with a scalar `ValueHead` as output layer (`value_head=True`: critic,
  reward model), so the model returns `[b, s, 1]` values instead of `[b, s, V/tp]` logits.

Building a role from an HF checkpoint is this plus loading its weights:
`checkpoint/hf_builders.py` (`build_actor`, `build_reference`, `build_critic`,
`build_reward_model`). Every degree comes from the run's `ParallelLayout`, which megatron-core
must have been initialised at (`distributed.init_megatron(layout)`); on a machine without
CUDA call `rl_megatron.cpu_compat.enable_if_no_gpu()` first.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from torch import Tensor

from rl_megatron.models.hf_config import HFModelInfo, gpt_model_kwargs, transformer_config_from_hf
from rl_megatron.models.specs import gpt_layer_spec
from rl_megatron.parallel import ParallelLayout


class ValueHead(MegatronModule):
    """Scalar head in place of `GPTModel.output_layer`: `[s, b, h]` → `[s, b, 1]`.

    Replicated on every TP rank (a 1-row output cannot be split over the vocabulary dim);
    it keeps `ColumnParallelLinear`'s call signature so `GPTModel` drives it unchanged.
    """

    def __init__(self, config: TransformerConfig, num_outputs: int = 1) -> None:
        super().__init__(config=config)
        device = "cpu" if config.use_cpu_initialization else torch.cuda.current_device()
        self.weight = torch.nn.Parameter(
            torch.empty(num_outputs, config.hidden_size, dtype=config.params_dtype, device=device)
        )
        # Marks the weight as a TP duplicate, so grad-norm and clipping count it once.
        tensor_parallel.set_defaults_if_not_set_tensor_model_parallel_attributes(self.weight)
        self.sequence_parallel = config.sequence_parallel

    @torch.no_grad()
    def reset_parameters(self, seed: int) -> None:
        """Normal(0, init_method_std) from a fixed seed, so every TP replica agrees."""
        gen = torch.Generator().manual_seed(seed)
        w = torch.randn(self.weight.shape, generator=gen) * self.config.init_method_std
        self.weight.copy_(w)

    def forward(
        self, hidden_states: Tensor, weight: Tensor | None = None, runtime_gather_output=None
    ) -> tuple[Tensor, None]:
        if self.sequence_parallel:
            # Values are computed replicated, so each rank's sequence slice gets its own
            # gradient slice back (split, not reduce-scatter).
            hidden_states = tensor_parallel.gather_from_sequence_parallel_region(
                hidden_states, tensor_parallel_output_grad=False
            )
        return F.linear(hidden_states, self.weight), None


def build_gpt_chunks(
    info: HFModelInfo,
    layout: ParallelLayout,
    *,
    dtype: torch.dtype = torch.bfloat16,
    value_head: bool = False,
    padded_vocab: int | None = None,
    make_vocab_size_divisible_by: int = 128,
    use_te: bool | None = None,
    perform_initialization: bool = True,
    **config_overrides,
) -> list[GPTModel]:
    """This rank's GPTModel chunks for `info`, randomly initialised (or left uninitialised).

    Args:
        info: parsed HF config.
        layout: the run's parallel layout (every degree; this rank's pipeline stages).
        dtype: parameter dtype.
        value_head: scalar `ValueHead` instead of the LM output layer (critic, reward).
        padded_vocab: fix the padded vocabulary (e.g. to a checkpoint's); default pads to
            a multiple of `make_vocab_size_divisible_by * tp`.
        use_te: Transformer Engine spec (None = when it imports).
        perform_initialization: False when weights are loaded right after (faster).
        config_overrides: extra `TransformerConfig` fields.
    """
    tp, pp, vpp = layout.tp, layout.pp, layout.vpp
    # A dense model has no experts to split, whatever megatron-core's expert mesh is.
    ep, etp = (layout.ep, layout.expert_tp) if info.is_moe else (1, 1)
    # Context and sequence parallelism are properties of the run, as megatron-core's RoPE,
    # attention and layers read them from the config to split and gather the sequence.
    config_overrides["context_parallel_size"] = layout.cp
    config_overrides["sequence_parallel"] = layout.sequence_parallel
    config = transformer_config_from_hf(
        info,
        tp=tp,
        pp=pp,
        vpp=vpp,
        ep=ep,
        etp=etp,
        dtype=dtype,
        perform_initialization=perform_initialization,
        **config_overrides,
    )
    kwargs = gpt_model_kwargs(
        info,
        tp=tp,
        make_vocab_size_divisible_by=make_vocab_size_divisible_by,
        padded_vocab=padded_vocab,
    )
    if value_head:
        # The head replaces the LM output layer, so there is nothing to tie.
        kwargs["share_embeddings_and_output_weights"] = False
    spec = gpt_layer_spec(
        use_te,
        qk_layernorm=config.qk_layernorm,
        num_experts=config.num_moe_experts,
        moe_grouped_gemm=config.moe_grouped_gemm,
    )
    chunks, rank = [], dist.get_rank()
    stages = vpp if vpp and vpp > 1 else None
    for vp_stage in range(stages or 1):
        stage = vp_stage if stages else None
        model = GPTModel(
            config=config,
            transformer_layer_spec=spec,
            pre_process=layout.is_first_stage(rank, stage),
            post_process=layout.is_last_stage(rank, stage),
            vp_stage=stage,
            **kwargs,
        )
        if value_head and model.post_process:
            model.output_layer = ValueHead(config)
        # megatron-core creates torch norms in fp32 whatever params_dtype says (Megatron-LM
        # casts the model in Float16Module); HF keeps them in the checkpoint's dtype too.
        model.to(dtype=dtype)
        # Logits carry padded_vocab / tp columns; ids >= this are padding and must be
        # masked (vocab_parallel's `vocab_size`) or sliced off before any softmax.
        model.true_vocab_size = info.vocab_size
        if torch.cuda.is_available():
            model.cuda(torch.cuda.current_device())
        chunks.append(model)
    return chunks


def mark_tensor_parallel_weights(chunks: list[GPTModel]) -> None:
    """Set megatron's `tensor_model_parallel` attributes on TP-split weights.

    megatron-core sets them only inside its weight initialisers, which
    `perform_initialization=False` skips; without them grad-norm and clipping treat a
    TP-sharded weight as a duplicate and count it on TP rank 0 only.
    """
    split_dims = {
        tensor_parallel.ColumnParallelLinear: 0,
        tensor_parallel.VocabParallelEmbedding: 0,
        tensor_parallel.RowParallelLinear: 1,
    }
    for chunk in chunks:
        for module in chunk.modules():
            dim = next((d for cls, d in split_dims.items() if isinstance(module, cls)), None)
            weight = getattr(module, "weight", None)
            if dim is None or weight is None or getattr(weight, "tensor_model_parallel", False):
                continue
            tensor_parallel.set_tensor_model_parallel_attributes(weight, True, dim, 1)
