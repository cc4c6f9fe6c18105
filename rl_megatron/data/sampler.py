"""Which prompts each data-parallel rank reads at each step: shuffled, sharded, resumable.

The order is a pure function of (seed, epoch): epoch `e` visits the dataset in the
permutation drawn from `(seed, e)`, cut into consecutive global batches of
`global_batch_size` prompts. DP rank `r` of `d` takes the `r`-th contiguous slice of each
global batch, so the `d` slices are disjoint and together are the whole batch. TP/PP/CP
ranks of one replica share its DP rank and so read the same prompts; no communication is
needed to agree on the data.

The state is `{"epoch", "position"}` (the next unread place in that epoch's permutation):
restoring it continues exactly the sequence an uninterrupted run would have produced.

At the end of an epoch fewer than a batch of prompts may be left. With `drop_last=True`
(default) they are dropped — counted in `dropped_per_epoch`, `metrics()` and a log line;
with `drop_last=False` they are carried: the next batch starts with them and is filled
from the next epoch's permutation (so one batch may hold a prompt twice, once per epoch).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING

import numpy as np

from rl_megatron.data.datasets import DataError

if TYPE_CHECKING:
    from rl_megatron.config import Config

__all__ = ["PromptSampler", "epoch_permutation", "eval_batches"]


def epoch_permutation(num_samples: int, seed: int, epoch: int, shuffle: bool = True) -> np.ndarray:
    """The visiting order of epoch `epoch`: a permutation of `range(num_samples)`.

    Seeded by the pair (seed, epoch) through numpy's SeedSequence, so nearby seeds and
    epochs give unrelated orders, and nothing depends on global RNG state.
    """
    if not shuffle:
        return np.arange(num_samples, dtype=np.int64)
    rng = np.random.default_rng([seed, epoch])
    return rng.permutation(num_samples).astype(np.int64)


class PromptSampler:
    """Deterministic, resumable iterator over one DP rank's share of each global batch.

    Args:
        num_samples: prompts in the dataset (after length filtering).
        global_batch_size: prompts per step over all DP ranks (`data.train_batch_size`).
        dp_rank: this rank's data-parallel index, in [0, dp_size).
        dp_size: data-parallel size; must divide `global_batch_size`.
        seed: base seed (`trainer.seed`), >= 0.
        shuffle: False visits the dataset in file order every epoch.
        drop_last: drop (True) or carry into the next epoch (False) the last incomplete batch.
        logger: where end-of-epoch drop notices go (default: the `rl_megatron` logger).
    """

    def __init__(
        self,
        num_samples: int,
        global_batch_size: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        seed: int = 0,
        shuffle: bool = True,
        drop_last: bool = True,
        logger: logging.Logger | None = None,
    ) -> None:
        if global_batch_size <= 0:
            raise DataError(f"data.train_batch_size: must be > 0, got {global_batch_size}")
        if dp_size <= 0 or not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank={dp_rank} is not in [0, dp_size={dp_size})")
        if global_batch_size % dp_size:
            raise DataError(
                f"data.train_batch_size: {global_batch_size} prompts do not split over "
                f"{dp_size} data-parallel ranks"
            )
        if seed < 0:
            raise DataError(f"trainer.seed: must be >= 0 for data shuffling, got {seed}")
        if num_samples <= 0:
            raise DataError("data.train_files: the dataset has no prompts")
        if drop_last and num_samples < global_batch_size:
            raise DataError(
                f"data.train_batch_size: the dataset has {num_samples} prompts, fewer than "
                f"one batch of {global_batch_size}; lower data.train_batch_size or add data"
            )
        self.num_samples = num_samples
        self.global_batch_size = global_batch_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.seed = seed
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.logger = logger or logging.getLogger("rl_megatron")
        self.epoch = 0
        self.position = 0
        self._order: np.ndarray | None = None  # permutation of self.epoch, built lazily
        self._order_epoch = -1

    @classmethod
    def from_config(
        cls, config: Config, num_samples: int, dp_rank: int, dp_size: int, drop_last: bool = True
    ) -> PromptSampler:
        """`data.train_batch_size`, `data.shuffle` and `trainer.seed` from the config."""
        return cls(
            num_samples,
            config.data.train_batch_size,
            dp_rank=dp_rank,
            dp_size=dp_size,
            seed=config.trainer.seed,
            shuffle=config.data.shuffle,
            drop_last=drop_last,
        )

    @property
    def local_batch_size(self) -> int:
        """Prompts per step on this DP rank."""
        return self.global_batch_size // self.dp_size

    @property
    def steps_per_epoch(self) -> int:
        """Whole global batches in one epoch (with carrying, a few epochs give one more)."""
        return self.num_samples // self.global_batch_size

    @property
    def dropped_per_epoch(self) -> int:
        """Prompts of the incomplete last batch that each epoch drops (0 when carried)."""
        return self.num_samples % self.global_batch_size if self.drop_last else 0

    def steps_for_epochs(self, epochs: int) -> int:
        """Steps that `epochs` passes over the data take (for `trainer.total_epochs`)."""
        if self.drop_last:
            return epochs * self.steps_per_epoch
        return epochs * self.num_samples // self.global_batch_size

    def next_global_batch(self) -> list[int]:
        """Dataset indices of the next global batch (all DP ranks), advancing the state."""
        batch: list[int] = []
        while len(batch) < self.global_batch_size:
            left = self.num_samples - self.position
            need = self.global_batch_size - len(batch)
            if self.drop_last and left < self.global_batch_size:
                # Only reached at a batch boundary: the remainder cannot fill a batch.
                self._end_epoch(dropped=left)
                continue
            take = min(left, need)
            order = self._permutation()
            batch.extend(order[self.position : self.position + take].tolist())
            self.position += take
            if self.position == self.num_samples:
                self._end_epoch(dropped=0)
        return batch

    def next_batch(self) -> list[int]:
        """Dataset indices this DP rank reads at the next step, advancing the state."""
        batch = self.next_global_batch()
        start = self.dp_rank * self.local_batch_size
        return batch[start : start + self.local_batch_size]

    def __iter__(self) -> Iterator[list[int]]:
        """Endless: the caller stops after its total steps or epochs."""
        while True:
            yield self.next_batch()

    def state_dict(self) -> dict[str, int]:
        """`{"epoch", "position"}` of the next unread prompt, plus the dataset size it
        refers to (checked on load so a changed dataset cannot resume a stale order)."""
        return {"epoch": self.epoch, "position": self.position, "num_samples": self.num_samples}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue from `state`; the rest of the sequence matches an uninterrupted run."""
        num_samples = state.get("num_samples", self.num_samples)
        if num_samples != self.num_samples:
            raise DataError(
                f"data.train_files: the checkpoint's data position refers to {num_samples} "
                f"prompts but the dataset now has {self.num_samples}; resume with the same "
                "data and length limits"
            )
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0 or not 0 <= position <= self.num_samples:
            raise DataError(f"data sampler state out of range: epoch={epoch} position={position}")
        self.epoch, self.position = epoch, position

    def metrics(self) -> dict[str, float]:
        """Flat `data/...` values describing where the run is in the data."""
        return {
            "data/epoch": float(self.epoch),
            "data/epoch_fraction": self.position / self.num_samples,
            # Deterministic in the epoch count, so it survives a resume without extra state.
            "data/dropped_prompts": float(self.epoch * self.dropped_per_epoch),
        }

    def _permutation(self) -> np.ndarray:
        if self._order_epoch != self.epoch:
            self._order = epoch_permutation(self.num_samples, self.seed, self.epoch, self.shuffle)
            self._order_epoch = self.epoch
        return self._order

    def _end_epoch(self, dropped: int) -> None:
        if dropped:
            self.logger.info(
                "data: epoch %d ended; the last %d prompts (fewer than a batch of %d) dropped",
                self.epoch,
                dropped,
                self.global_batch_size,
            )
        self.epoch += 1
        self.position = 0


def eval_batches(
    num_samples: int, batch_size: int, dp_rank: int = 0, dp_size: int = 1
) -> Iterator[list[int]]:
    """Every prompt once, in order: this DP rank's share of each global batch.

    The last batch may be smaller; its prompts are spread so that rank shares differ by at
    most one (a rank's share can be empty), so the caller must cope with uneven shards.
    """
    if batch_size <= 0:
        raise DataError(f"data.val_batch_size: must be > 0, got {batch_size}")
    if dp_size <= 0 or not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank={dp_rank} is not in [0, dp_size={dp_size})")
    for start in range(0, num_samples, batch_size):
        batch = np.arange(start, min(start + batch_size, num_samples), dtype=np.int64)
        yield np.array_split(batch, dp_size)[dp_rank].tolist()
