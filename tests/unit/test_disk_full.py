"""A full disk (issue 36) outside the trainer's collectives: the one line itself, the
start-up cleanup of what interrupted saves and HF exports leave, the HF folder's atomic
replacement, and `data.prepare` on ENOSPC (one line, exit 2, source untouched, no partial).

ENOSPC is injected at the write (the real thing needs a small filesystem, i.e. root)."""

from __future__ import annotations

import errno
import json
import os
import pathlib
import re
import shutil
from pathlib import Path

import pytest

from rl_megatron.checkpoint import step_dirs
from rl_megatron.checkpoint.hf_export import commit_output_dir
from rl_megatron.data.prepare import main as prepare
from rl_megatron.utils.disk_space import disk_full_cause, gigabytes, no_space_line

ENOSPC = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_the_line_names_path_needed_and_free(tmp_path):
    line = no_space_line(tmp_path / "not" / "yet", 4_500_000_000)
    free = shutil.disk_usage(tmp_path).free / 1e9
    match = re.fullmatch(
        rf"no space left on device writing {tmp_path}/not/yet; 4\.50 GB needed, (\S+) GB free",
        line,
    )
    assert match, line
    assert abs(float(match.group(1)) - free) < 0.1
    assert gigabytes(0) == "0.00"
    assert gigabytes(45_000) == "0.000045"  # small files keep their size
    assert gigabytes(300) == "0.00000030"
    assert gigabytes(9_999_999) == "0.0100"
    assert gigabytes(10_000_000) == "0.01"


def test_full_disk_is_found_behind_wrappers():
    try:
        try:
            raise ENOSPC
        except OSError as exc:
            raise RuntimeError("Worker failure") from exc
    except RuntimeError as wrapped:
        assert disk_full_cause(wrapped).errno == errno.ENOSPC
    quota = OSError(errno.EDQUOT, "Disk quota exceeded")
    assert disk_full_cause(quota) is quota
    # pickled across processes (megatron-core's gather): only the text is left
    assert disk_full_cause(RuntimeError("Worker failure: [Errno 28] No space left on device"))
    assert disk_full_cause(OSError(errno.EACCES, "Permission denied")) is None
    assert disk_full_cause(RuntimeError("[Errno 13] Permission denied")) is None


def _complete(path: Path, marker: str) -> Path:
    path.mkdir(parents=True)
    (path / step_dirs.STATE_FILE).write_text(marker)
    return path


def test_start_up_removes_leftovers_and_keeps_the_last_checkpoint(tmp_path):
    ckpts, hf = tmp_path / "checkpoints", tmp_path / "hf"
    _complete(ckpts / "step_00000004", "4")
    (ckpts / "step_00000008.tmp-0123456789ab" / "actor").mkdir(parents=True)
    (ckpts / "step_00000008.tmp-0123456789ab" / "actor" / "big").write_bytes(b"x" * 1000)
    (ckpts / "step_00000002.del-0123456789ab").mkdir()
    # a re-save killed between its two renames: the old copy is all there is of step 6
    _complete(ckpts / "step_00000006.old-0123456789ab", "6")
    (hf / "step_00000004").mkdir(parents=True)
    (hf / ".step_00000008.partial").mkdir()
    (hf / ".step_00000003.deleting").mkdir()
    (hf / ".source.tmp").mkdir()
    # an HF re-export killed between its renames: the aside copy goes back in place
    (hf / ".step_00000006.aside-0123456789ab").mkdir()
    (hf / ".step_00000006.aside-0123456789ab" / "config.json").write_text("{}")
    (hf / ".step_00000006.partial").mkdir()
    # an aside copy whose folder exists (killed before deleting it): removed
    (hf / ".step_00000004.aside-0123456789ab").mkdir()

    done = step_dirs.remove_leftovers(ckpts, hf)

    assert sorted(p.name for p in ckpts.iterdir()) == ["step_00000004", "step_00000006"]
    assert (ckpts / "step_00000006" / step_dirs.STATE_FILE).read_text() == "6"
    assert step_dirs.latest(ckpts) == ckpts / "step_00000006"
    assert sorted(p.name for p in hf.iterdir()) == ["step_00000004", "step_00000006"]
    assert (hf / "step_00000006" / "config.json").read_text() == "{}"
    assert f"removed {ckpts / 'step_00000008.tmp-0123456789ab'}" in done
    assert f"removed {hf / '.step_00000008.partial'}" in done
    assert len(done) == 8, done
    assert step_dirs.remove_leftovers(ckpts, hf) == []  # nothing the second time
    assert step_dirs.remove_leftovers(tmp_path / "none", tmp_path / "none") == []


def test_hf_folder_replacement_keeps_one_complete_folder(tmp_path, monkeypatch):
    out = tmp_path / "step_00000004"
    out.mkdir()
    (out / "model.safetensors").write_text("old")
    new = tmp_path / ".step_00000004.partial"
    new.mkdir()
    (new / "model.safetensors").write_text("new")
    # a kill right after the old folder went aside: the old one is complete, and put back
    renames = []
    real_replace = os.replace

    def killed(src, dst):
        renames.append((Path(src).name, Path(dst).name))
        raise KeyboardInterrupt  # stands for the kill

    monkeypatch.setattr(os, "replace", killed)
    with pytest.raises(KeyboardInterrupt):
        commit_output_dir(new, out)
    monkeypatch.setattr(os, "replace", real_replace)
    assert not out.exists() and renames == [(new.name, out.name)]
    step_dirs.remove_leftovers(tmp_path / "checkpoints", tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000004"]
    assert (out / "model.safetensors").read_text() == "old"
    # uninterrupted: the new folder in place, no aside copy left
    new.mkdir()
    (new / "model.safetensors").write_text("new")
    commit_output_dir(new, out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000004"]
    assert (out / "model.safetensors").read_text() == "new"


ROWS = [
    {"question": "Natalia sold 48 clips. How many?", "answer": "48 / 2 = 24\n#### 72"},
    {"question": "Weng earns $12 an hour.", "answer": "12 * 100 = 1200\n#### 1,200"},
]


class _FullFile:
    """A text file on a disk that fills up after `room` characters."""

    def __init__(self, f, room: int) -> None:
        self.f, self.room = f, room

    def write(self, text: str) -> int:
        if len(text) > self.room:
            self.f.write(text[: self.room])
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.room -= len(text)
        return self.f.write(text)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.f.close()


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_prepare_on_a_full_disk_is_one_line(tmp_path, capsys, monkeypatch, suffix):
    source = tmp_path / "gsm8k.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    before = source.read_bytes()
    # N: what the records take as JSONL, i.e. the size of a complete .jsonl output
    assert prepare([str(source), "--preset", "gsm8k", "--out", str(tmp_path / "ok.jsonl")]) == 0
    needed = (tmp_path / "ok.jsonl").stat().st_size
    capsys.readouterr()
    out = tmp_path / "data" / f"train{suffix}"
    if suffix == ".jsonl":
        real_open = pathlib.Path.open

        def full_open(self, *args, **kwargs):
            f = real_open(self, *args, **kwargs)
            return _FullFile(f, 50) if self.name.endswith(".partial") else f

        monkeypatch.setattr(pathlib.Path, "open", full_open)
    else:
        import pyarrow.parquet as pq

        def full_write(table, where, **kwargs):
            Path(where).write_bytes(b"PAR1 half")
            raise ENOSPC

        monkeypatch.setattr(pq, "write_table", full_write)
    code = prepare([str(source), "--preset", "gsm8k", "--out", str(out)])
    captured = capsys.readouterr()
    assert code == 2
    lines = captured.err.splitlines()
    assert len(lines) == 1, captured.err
    assert re.fullmatch(
        rf"python -m rl_megatron\.data\.prepare: error: no space left on device writing {out}; "
        rf"{re.escape(gigabytes(needed))} GB needed, \S+ GB free",
        lines[0],
    ), lines[0]
    assert captured.out == ""
    assert source.read_bytes() == before
    assert sorted(p.name for p in out.parent.iterdir()) == []  # no output, no .partial


def test_start_up_completes_or_removes_a_lora_base_copy(tmp_path):
    """A LoRA run's base copy (`checkpoints/lora_base/<role>`) follows the step folders'
    protocol: a copy being written is removed, one moved aside by a killed re-write is put
    back where it has no successor, and removed where it has one."""
    ckpts = tmp_path / "checkpoints"
    base = ckpts / step_dirs.BASE_DIR
    (base / "actor.tmp-0123456789ab").mkdir(parents=True)
    (base / "actor.old-0123456789ab").mkdir()
    (base / "actor.old-0123456789ab" / "manifest.json").write_text("{}")
    (base / "critic").mkdir()
    (base / "critic.old-0123456789ab").mkdir()

    done = step_dirs.remove_leftovers(ckpts, tmp_path / "hf")

    assert sorted(p.name for p in base.iterdir()) == ["actor", "critic"]
    assert (base / "actor" / "manifest.json").read_text() == "{}"
    assert f"removed {base / 'actor.tmp-0123456789ab'}" in done
    assert len(done) == 3, done
    assert step_dirs.remove_leftovers(ckpts, tmp_path / "hf") == []
