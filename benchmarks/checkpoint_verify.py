"""The cost of checkpoint checksums (`rl_megatron/checkpoint/integrity.py`), as JSON.

    .venv/bin/python benchmarks/checkpoint_verify.py --gib 2
    .venv/bin/python benchmarks/checkpoint_verify.py --ckpt runs/x/checkpoints/step_00000042

Writes one synthetic file of `--gib` GiB in 64 MiB pieces (the size of a large tensor
record), plainly and through the hashing writer a save uses (alternating, best of two),
and reports both write rates and CPU seconds per GB; then re-reads it as `verify_share` does (CRC-32, one process; the file is in the page
cache, so this is the hashing's own rate, a bound the disk may lower) and reports CRC-32's
and sha256's rates on the same bytes in memory. `--dir /dev/shm` takes the disk out of
the write rates (then they compare copying with copying and hashing). With `--ckpt` (a training checkpoint's
step directory) it also times a whole single-process verification: rank 0's listing checks
plus every file's checksum.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import tempfile
import time
import zlib
from pathlib import Path

from rl_megatron.checkpoint import integrity

PIECE = 64 << 20


def _write(path: Path, piece: bytes, count: int, hashed: bool) -> tuple[float, float]:
    """(wall, CPU) seconds to write and fsync `count` pieces into a fresh file, plainly or
    through the hashing writer."""
    path.unlink(missing_ok=True)
    wall, cpu = time.perf_counter(), time.process_time()
    with integrity.open_hashed(path) if hashed else open(path, "wb") as f:
        for _ in range(count):
            f.write(piece)
        f.flush()
        os.fsync(f.fileno())
    return time.perf_counter() - wall, time.process_time() - cpu


def synthetic(gib: float, directory: Path, repeats: int = 2) -> dict:
    """Write rates (best of `repeats`, alternating) and CPU cost, then the verify rate."""
    count = max(1, int(gib * 2**30) // PIECE)
    piece = os.urandom(PIECE)
    nbytes = count * PIECE
    path = directory / "synthetic.bin"
    runs: dict[bool, list] = {False: [], True: []}
    for _ in range(repeats):
        for hashed in (False, True):
            runs[hashed].append(_write(path, piece, count, hashed))
    wall, cpu = time.perf_counter(), time.process_time()
    integrity.hash_file(path)  # the file was just written: read from the page cache
    verify_wall, verify_cpu = time.perf_counter() - wall, time.process_time() - cpu
    start = time.perf_counter()
    crc = 0
    for _ in range(count):
        crc = zlib.crc32(piece, crc)
    crc_s = time.perf_counter() - start
    start = time.perf_counter()
    digest = hashlib.sha256()
    for _ in range(count):
        digest.update(piece)
    sha = time.perf_counter() - start
    gb = nbytes / 1e9
    return {
        "bytes": nbytes,
        "write_plain_gb_s": gb / min(w for w, _ in runs[False]),
        "write_hashed_gb_s": gb / min(w for w, _ in runs[True]),
        "write_plain_cpu_s_per_gb": min(c for _, c in runs[False]) / gb,
        "write_hashed_cpu_s_per_gb": min(c for _, c in runs[True]) / gb,
        "verify_crc32_gb_s": gb / verify_wall,
        "verify_crc32_cpu_s_per_gb": verify_cpu / gb,
        "crc32_in_memory_gb_s": gb / crc_s,
        "sha256_in_memory_gb_s": gb / sha,
    }


def checkpoint(step_dir: Path) -> dict:
    from rl_megatron.checkpoint.state_checks import check_checkpoint

    meta = json.loads((step_dir / "trainer_state.json").read_text())
    start = time.perf_counter()
    _, files = check_checkpoint(step_dir, sorted(meta["roles"]), verify=True)
    listed = time.perf_counter()
    problem = integrity.verify_share(step_dir, files)
    done = time.perf_counter()
    assert problem is None, problem
    return {
        "files": len(files),
        "bytes": sum(e["size"] for e in files.values()),
        "listing_s": listed - start,
        "checksums_s": done - listed,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--gib", type=float, default=2.0, help="size of the synthetic file")
    p.add_argument("--dir", type=Path, default=None, help="where to write it (default: tmp)")
    p.add_argument("--ckpt", type=Path, default=None, help="a training step directory")
    args = p.parse_args()
    result: dict = {"cpu_count": os.cpu_count(), "load_average": os.getloadavg()[0]}
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        result["synthetic"] = synthetic(args.gib, Path(tmp))
    if args.ckpt is not None:
        result["checkpoint"] = checkpoint(args.ckpt)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
