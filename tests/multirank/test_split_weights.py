"""Split placement's weight path on 4 gloo ranks, bit for bit (`trainer/split_rollouts.py`).

Ranks 0-1 train (an actor at TP 2, built from an HF checkpoint by the trainer's builder);
ranks 2-3 generate with the Megatron engine, whose weights start as NaN: either two
engines at TP 1, each fed the whole model in turn by the one training replica (a run's
config refuses more generation replicas than training replicas, as each generates whole
batches of its own; the weight path takes any number), or one engine at TP 2, each rank
its TP shard. Every row comes from the training rank of the TP 2 pair that holds it
(`resharding/remote.py`). Two versions cross: the checkpoint's weights, then every actor weight times 1.5 (what an
update does, as far as the layout is concerned: new values everywhere). After each, every
parameter of each engine must equal, bit for bit, what Megatron loads from the checkpoint
(scaled alike) at TP 1, computed here independently (`tests/reshard_refs.py`); the model
is Qwen3 with QK-norm, tied embeddings and a vocabulary of 100 that TP 2 and TP 1 pad
differently (256 vs 128 rows), so a padding row sent as a weight would show. Then a stop.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

from tests.reshard_refs import MODELS
from tests.spawn import ON_GPU, run_on_ranks

pytestmark = pytest.mark.slow

MODEL = "qwen3_padded_vocab"
SCALE = 1.5


def _body(rank: int, world_size: int, spec: dict) -> None:
    import torch.distributed as dist
    from safetensors.torch import load_file

    from rl_megatron.distributed import init_megatron, launch_env
    from rl_megatron.models.hf_config import load_hf_config
    from rl_megatron.parallel import ParallelLayout
    from rl_megatron.placement import init_split_world

    dist.destroy_process_group()  # the spawn's world: this test makes its own two
    os.environ["MASTER_PORT"] = str(spec["port"])
    world, device = init_split_world(launch_env(), 2, timeout_s=120, rendezvous_timeout_s=60)
    assert world.generates == (rank >= 2) and dist.get_world_size() == 2
    info = load_hf_config(spec["ckpt"])
    training = ParallelLayout(tp=2, pp=1, dp=1)
    if world.generates:
        state = load_file(f"{spec['ckpt']}/model.safetensors")
        _generate(world, device, info, training, state, spec["rollout_tp"])
        return
    from rl_megatron.checkpoint.hf_builders import build_actor
    from rl_megatron.trainer.split_rollouts import training_side

    init_megatron(training, 120)
    actor = build_actor(spec["ckpt"], training, dtype=torch.float32)
    run = SimpleNamespace(
        split=world,
        layout=training,
        device=device,
        coordinates={"dp": 0},
        groups=SimpleNamespace(replica=dist.group.WORLD),
    )
    t_g = spec["rollout_tp"]
    config = SimpleNamespace(
        rollout=SimpleNamespace(tp=t_g, weight_sync_bucket_mb=1 / 64),
        model=SimpleNamespace(dtype="fp32"),
        placement=SimpleNamespace(rollout_ranks=2),
    )
    side = training_side(config, info, run)
    # t_g 1: the block feeds both replicas, one after the other (a run's config refuses
    # more replicas than training replicas; the weight path takes them); t_g 2: one.
    replicas = [[2], [3]] if t_g == 1 else [[2, 3]]
    sent = []
    for version in (0, 1, 2):
        if version == 1:
            with torch.no_grad():
                for chunk in actor:
                    for param in chunk.parameters():
                        param.mul_(SCALE)
        for generation in replicas:
            side.sender.peers = [0, 1, *generation]
            if version == 2:
                side.sender.stop(2)
            else:
                sent.append(side._send_weights(actor, version)["reshard/sent_gb"])
    # each training rank sends about half of the model each time, the same every time
    assert len(set(sent)) == 1 and sent[0] > 0


def _generate(world, device, info, training, state, t_g: int) -> None:
    from rl_megatron.distributed import init_megatron
    from rl_megatron.models.builders import build_gpt_chunks
    from rl_megatron.parallel import ParallelLayout
    from rl_megatron.resharding.remote import RemoteReceiver
    from rl_megatron.rollout.megatron.engine import MegatronEngine
    from rl_megatron.rollout.megatron.target import MegatronEngineTarget
    from rl_megatron.trainer.split_rollouts import remote_key, send_object
    from tests.multirank.test_resharding import _mismatches
    from tests.reshard_refs import megatron_reference

    layout = ParallelLayout(tp=t_g, pp=1, dp=2 // t_g)
    init_megatron(layout, 120)
    chunks = build_gpt_chunks(info, layout, dtype=torch.float32, perform_initialization=False)
    engine = MegatronEngine(chunks, info, max_model_len=64, use_cuda_graphs=False)
    target = MegatronEngineTarget(engine)
    padded = target.padded_vocab()
    assert padded == 128 * t_g  # TP 2 pads the training side's embedding to 256
    gen_tp = world.side_rank if t_g == 2 else 0
    if world.side_rank == 0:  # what GenerationSide.handshake tells every training rank
        for rank in range(world.train_size):
            facts = {"shard_specs": target.shard_specs, "padded_vocab": padded}
            send_object(world, facts, world.training_rank(rank), device)
    config = SimpleNamespace(rollout=SimpleNamespace(tp=t_g, weight_sync_bucket_mb=1 / 64))
    receiver = RemoteReceiver(
        target,
        remote_key(config, info, training, target.shard_specs, padded),
        gen_tp=gen_tp,
        transport=world.exchange,
        recv_header=world.recv,
        peers=[0, 1, world.rank] if t_g == 1 else [0, 1, 2, 3],
        dtype=torch.float32,
        device=device,
    )
    for version in (0, 1):
        for param in chunks[0].parameters():
            param.data.fill_(float("nan"))
        assert receiver.receive() == version
        assert engine.weight_version == version
        scaled = {name: t * SCALE**version for name, t in state.items()}
        want = megatron_reference(scaled, info, t_g, gen_tp, padded)
        bad = _mismatches({k: v.data for k, v in target.params.items()}, want)
        assert not bad, f"version {version}: {bad[:4]}"
    assert receiver.receive() is None  # the stop


@pytest.mark.skipif(ON_GPU, reason="gloo ranks: the bridge here is CPU tensors")
@pytest.mark.parametrize("rollout_tp", [1, 2])
def test_generation_ranks_hold_the_training_weights_bit_for_bit(tmp_path, rollout_tp):
    from transformers import AutoModelForCausalLM, Qwen3Config

    from tests.ports import reserve_port

    cfg = dict(MODELS[MODEL])
    cfg.pop("model_type")
    config = Qwen3Config(**cfg, initializer_range=0.1, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(3)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # QK-norms far from 1 and from each other
        for name, p in model.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                p.uniform_(0.25, 1.75)
    model.save_pretrained(tmp_path / MODEL, safe_serialization=True)
    run_on_ranks(
        _body,
        world_size=4,
        spec={"ckpt": str(tmp_path / MODEL), "port": reserve_port(), "rollout_tp": rollout_tp},
    )
