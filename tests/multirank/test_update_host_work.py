"""The host work of `MegatronRole.train_steps` (an actor-update phase) that is ours, not
megatron-core's: what a launch-bound update on a GPU pays for directly.

One rank, test_roles' tiny Llama and batch, three optimizer steps of four rows in one
call, in fixed micro-batches of one row (anything done per micro-batch shows up four
times per step) and in token-budget (dynamic) micro-batches. The call starts in eval
mode, as the old-log-prob pass leaves the actor. Per call:

  (a) device reads (`.item()`, `.tolist()`, `.cpu()`, `bool`/`int`/`float` of a tensor,
      `nonzero`, ...) made from rl_megatron code: exactly one `.cpu()` of the mask, one
      `.item()` per optimizer step (every rank's loss finite, `step_if_finite`) and one
      `.tolist()` of all steps' metrics (`step_metrics.resolve`); none per micro-batch.
      Reads of the mask's host copy (or of tensors computed from it: the micro-batches'
      shapes, the token-budget split) are not device reads. On a GPU every device read
      waits for the device, which then idles while the host issues the next kernels.
      megatron-core's own reads (its gradient norm) are the same as a plain loop's and
      are not counted;
  (b) training mode is set once per call (`Module.train()` walks every submodule: 3.3k
      with 16 layers of 64 experts, ~10 ms of host time), and every module is in it.

On CPU every tensor is a host tensor, so device reads are told apart by where a tensor
came from: the result of the `.cpu()` in `train_steps` (made a copy, as on a GPU), and
anything computed from it, is the host copy.
"""

from __future__ import annotations

import collections
import sys

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from tests.spawn import run_on_ranks

STEPS = [[0, 1, 2, 3], [4, 5, 6, 7], [0, 2, 4, 6]]
# Calls that copy a tensor's values to the host (on a GPU: wait for the device).
READS = {
    "item",
    "tolist",
    "cpu",
    "numpy",
    "__bool__",
    "__int__",
    "__float__",
    "__index__",
    "nonzero",
    "masked_select",
    "unique",
}


class DeviceReads(TorchFunctionMode):
    """Counts reads of values by rl_megatron code, per (function, call), skipping reads of
    the host copy made by `train_steps` and of what is computed from it."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter = collections.Counter()
        # ids of host tensors, kept alive so that no id is reused (a WeakSet would compare
        # tensors with ==, itself a torch call).
        self._host: dict[int, torch.Tensor] = {}

    def _ours(self) -> str | None:
        """The innermost calling function outside torch, if it is rl_megatron's."""
        frame = sys._getframe(2)
        while frame is not None:
            path = frame.f_code.co_filename
            if "/rl_megatron/" in path and not path.endswith("cpu_compat.py"):
                return frame.f_code.co_name
            if "/torch/" not in path:
                return None
            frame = frame.f_back
        return None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        tensors = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
        from_host = any(id(t) in self._host for t in tensors)
        site = self._ours()
        if name in READS and site is not None and not from_host:
            self.counts[f"{site}: {name}"] += 1
        out = func(*args, **kwargs)
        if name == "cpu" and site == "train_steps":
            # On CPU, `.cpu()` returns the tensor itself; on a GPU it is a copy.
            out = out.clone()
            from_host = True
        if from_host:
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    self._host[id(t)] = t
        return out


def _body(rank: int, world_size: int, root) -> None:
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from tests.multirank.test_roles import _actor, _ppo_loss

    ps.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(0)
    batch = torch.load(root / "batch.pt")
    batch.pop("ref_grad_norm")
    expected = {
        "train_steps: cpu": 1,
        "step_if_finite: item": len(STEPS),
        "resolve: tolist": 1,
    }
    for dynamic in (False, True):
        # Token budget: two of the longest rows (11 tokens) per micro-batch.
        kw = dict(use_dynamic_batch=True, max_tokens_per_micro_batch=22) if dynamic else {}
        kw.setdefault("micro_batch_size", 1)
        actor = _actor(root, 1, 1, None, **kw)
        actor.forward_only(batch)  # leaves the chunks in eval mode, as a rollout phase does
        walks = collections.Counter()
        for chunk in actor.model:
            # An instance attribute shadows Module.train for calls on the chunk itself.
            def train(mode=True, chunk=chunk, original=chunk.train, walks=walks):
                walks[id(chunk)] += 1
                return original(mode)

            chunk.train = train
        reads = DeviceReads()
        with reads:
            metrics = actor.train_steps(batch, STEPS, _ppo_loss)
        label = "dynamic" if dynamic else "fixed"
        assert len(metrics) == len(STEPS) and all(m["update_successful"] for m in metrics)
        assert dict(reads.counts) == expected, f"{label}: device reads {dict(reads.counts)}"
        assert list(walks.values()) == [1] * len(actor.model), f"{label}: train() {walks}"
        modes = {m.training for chunk in actor.model for m in chunk.modules()}
        assert modes == {True}, f"{label}: some modules are not in training mode"


def test_update_host_work(tmp_path):
    from tests.multirank.test_roles import _make_checkpoint

    _make_checkpoint(tmp_path)
    run_on_ranks(_body, world_size=1, root=tmp_path)
