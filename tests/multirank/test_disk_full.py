"""A full disk while the trainer writes (issue 36), on 2 ranks of the tiny CPU model: every
rank raises the same one-line DiskFullError (none is left in a collective), the failed
save's temporaries are gone, the previous checkpoint and HF folder stay complete and load;
a resumed run redoes an HF export that a kill interrupted.

ENOSPC is injected at the write itself (`integrity.HashingWriter.write`, which every
checkpoint file goes through, or the HF exporter's safetensors writer), on one rank only.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import logging
import os
import re
import shutil
from pathlib import Path

import pytest

from rl_megatron.utils.disk_space import gigabytes
from tests.spawn import run_on_ranks

TINY = Path(__file__).resolve().parents[2] / "yaml_configs" / "tiny_cpu.yaml"
OVERRIDES = [
    "model.hf_path=null",
    "rollout.n=2",
    "data.train_batch_size=2",
    "actor.mini_batch_size=4",
    "actor.micro_batch_size=2",
    "checkpoint.save_hf=true",
    "trainer.total_steps=4",
    "trainer.val_interval=0",
]
LINE = re.compile(r"^no space left on device writing (\S+); (\S+) GB needed, (\S+) GB free$")


@contextlib.contextmanager
def _full_disk(rank: int, on_rank: int, name: str):
    """Every checkpoint file write whose file name contains `name` fails with ENOSPC on
    rank `on_rank`."""
    from rl_megatron.checkpoint import integrity

    original = integrity.HashingWriter.write

    def write(self, data):
        if rank == on_rank and name in os.path.basename(self._file.name):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return original(self, data)

    integrity.HashingWriter.write = write
    try:
        yield
    finally:
        integrity.HashingWriter.write = original


def _disk_size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _digest(folder: Path) -> dict[str, str]:
    return {
        str(f.relative_to(folder)): hashlib.sha256(f.read_bytes()).hexdigest()
        for f in sorted(folder.rglob("*"))
        if f.is_file()
    }


def _lines_of_every_rank(line: str) -> list[str]:
    import torch.distributed as dist

    lines: list = [None] * dist.get_world_size()
    dist.all_gather_object(lines, line)
    return lines


def _body(rank: int, world_size: int, tmp_path: Path) -> None:
    import torch.distributed as dist

    from rl_megatron.checkpoint import hf_export
    from rl_megatron.config import load_config
    from rl_megatron.distributed import distributed_run
    from rl_megatron.parallel import ParallelLayout
    from rl_megatron.trainer.checkpointing import remove_leftovers
    from rl_megatron.trainer.ppo_trainer import build_trainer
    from rl_megatron.utils.disk_space import DiskFullError

    config = load_config(TINY, [f"trainer.output_dir={tmp_path}", *OVERRIDES])
    run_dir = config.run_dir
    ckpts, hf = run_dir / "checkpoints", run_dir / "hf"
    log = logging.getLogger("test")
    with distributed_run(
        ParallelLayout.from_config(config.parallel, world_size), seed=config.trainer.seed
    ) as run:
        trainer = build_trainer(config, run, log)
        trainer.step = 1
        trainer.save()  # the last complete checkpoint and HF folder
        dist.barrier()
        good = ckpts / "step_00000001"
        good_digest, hf_digest = _digest(good), _digest(hf / "step_00000001")
        good_size = _disk_size(good)

        # 1. ENOSPC on rank 1 only, inside megatron-core's writer (its shard files).
        trainer.step = 2
        with _full_disk(rank, 1, "__"), pytest.raises(DiskFullError) as caught:
            trainer.checkpoints.save(2)
        lines = _lines_of_every_rank(str(caught.value))
        assert lines[0] == lines[1], lines
        match = LINE.match(lines[0])
        assert match, lines[0]
        assert match.group(1) == str(ckpts / "step_00000002")
        # N: the checkpoint's expected size, the last complete one's (larger than the
        # parameters-and-Adam estimate of this fp32 model)
        assert match.group(2) == gigabytes(good_size), (match.group(2), good_size)
        assert float(match.group(3)) >= 0
        # 2. ENOSPC on rank 0 only, writing a role's manifest (after megatron-core's part).
        with _full_disk(rank, 0, "manifest"), pytest.raises(DiskFullError) as caught:
            trainer.checkpoints.save(2)
        lines = _lines_of_every_rank(str(caught.value))
        assert lines[0] == lines[1] and LINE.match(lines[0]), lines
        # 3. ENOSPC on rank 1 only, writing its RNG file.
        with _full_disk(rank, 1, "rank_00001"), pytest.raises(DiskFullError) as caught:
            trainer.checkpoints.save(2)
        lines = _lines_of_every_rank(str(caught.value))
        assert lines[0] == lines[1] and LINE.match(lines[0]), lines
        dist.barrier()
        # Nothing of the failed saves is left; the previous checkpoint is as it was.
        assert sorted(p.name for p in ckpts.iterdir()) == ["step_00000001"]
        assert _digest(good) == good_digest
        assert trainer.checkpoints.manager.latest() == good

        # 4. ENOSPC on rank 0 (the HF writer) during the HF export of step 2.
        original = hf_export._SafetensorsFile.write

        def full(self, name, tensor):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        hf_export._SafetensorsFile.write = full
        try:
            with trainer.roles.actor.on_device(), pytest.raises(DiskFullError) as caught:
                trainer.hf_snapshots.save(trainer.roles.actor.model, 2, log)
        finally:
            hf_export._SafetensorsFile.write = original
        lines = _lines_of_every_rank(str(caught.value))
        assert lines[0] == lines[1], lines
        match = LINE.match(lines[0])
        assert match and match.group(1) == str(hf / "step_00000002"), lines[0]
        dist.barrier()
        assert sorted(p.name for p in hf.iterdir()) == [".source", "step_00000001"]
        assert _digest(hf / "step_00000001") == hf_digest

        # 5. A kill during the export of step 1 (its folder gone, a .partial left): the
        # next start removes the .partial, the resumed run exports step 1 again, the same.
        dist.barrier()  # every rank has read the folder above before rank 0 removes it
        if rank == 0:
            shutil.rmtree(hf / "step_00000001")
            (hf / ".step_00000001.partial").mkdir()
            (hf / ".step_00000001.partial" / "model.safetensors").write_bytes(b"half")
            (ckpts / "step_00000002.tmp-0123456789ab").mkdir()  # a killed save's
            remove_leftovers(run_dir, log)
            assert sorted(p.name for p in hf.iterdir()) == [".source"]
            assert sorted(p.name for p in ckpts.iterdir()) == ["step_00000001"]
        dist.barrier()
        trainer.step = 0
        trainer.resume()
        assert trainer.step == 1
        dist.barrier()
        assert _digest(hf / "step_00000001") == hf_digest
        # Complete: nothing to redo.
        assert trainer.hf_snapshots.redo_missing(trainer.roles.actor.model, 1, log) is None


@pytest.mark.slow
def test_a_full_disk_is_one_line_on_every_rank_and_loses_nothing(tmp_path):
    run_on_ranks(_body, world_size=2, tmp_path=tmp_path)
