"""Break one line of the trainer at a time; the tests that guard it must fail for each.

    .venv/bin/python tests/mutations.py            # every mutation (~10 minutes on 2 cores)
    .venv/bin/python tests/mutations.py sign GRPO  # those whose name contains a word

Each mutation copies the repository (without .venv and .git) to a temporary folder,
replaces one exact line there, and runs the test that must catch it against the copy
(PYTHONPATH puts the copy first, spawned ranks included). A mutation the test does not
catch is printed MISSED and the script exits 1. Not part of `make test`: it re-runs the
slowest tests once per mutation. The faults are issue 17's list (the one-line faults that
once passed the whole suite) and the bugs the reference step found.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = "tests/multirank/test_trainer_reference.py"
ONE_RANK = f"{REFERENCE}::test_one_rank_every_estimator_and_loss_mode"
TP_DP = f"{REFERENCE}::test_four_ranks[tp2-dp2]"
VPP = f"{REFERENCE}::test_four_ranks[pp2-vpp2-dp2]"
NONFINITE = "tests/multirank/test_nonfinite_update.py"
TRAINER = "rl_megatron/trainer/ppo_trainer.py"
ROLES = "rl_megatron/trainer/roles.py"

# (name, file, exact text, replacement, the test that must fail)
MUTATIONS = [
    (
        "old log-probs replaced by the new (ratio 1)",
        TRAINER,
        'mb["old_log_prob"],',
        'out["log_prob"].detach(),',
        ONE_RANK,
    ),
    ("critic trained towards its own values", TRAINER, 'mb["returns"],', 'mb["values"],', ONE_RANK),
    (
        "KL-in-reward arguments swapped",
        TRAINER,
        'batch["old_log_prob"],\n                batch["ref_log_prob"],',
        'batch["ref_log_prob"],\n                batch["old_log_prob"],',
        ONE_RANK,
    ),
    (
        "KL-loss sign flipped",
        TRAINER,
        "loss = loss + a.kl_loss_coef * kl",
        "loss = loss - a.kl_loss_coef * kl",
        ONE_RANK,
    ),
    (
        "entropy-bonus sign flipped",
        TRAINER,
        "loss = loss - a.entropy_coeff * bonus",
        "loss = loss + a.entropy_coeff * bonus",
        ONE_RANK,
    ),
    (
        "every GRPO group merged into one",
        TRAINER,
        "group_index=rollout.group_index.to(self.device)",
        "group_index=torch.zeros_like(rollout.group_index).to(self.device)",
        ONE_RANK,
    ),
    (
        "critic reads the wrong column",
        ROLES,
        'index = batch["gather_index"] + (1 - self.output_shift) * self.value_head',
        'index = batch["gather_index"] + self.value_head',
        ONE_RANK,
    ),
    (
        "interleaved filler rows counted as response tokens",
        "rl_megatron/trainer/micro_batches.py",
        'sub["response_mask"][len(rows) :] = 0',
        "pass",
        VPP,
    ),
    (
        "seq-mean-token-sum-norm by the micro-batch's width",
        TRAINER,
        "totals=totals,\n            norm_len=norm_len,\n        )\n        if a.entropy_coeff",
        "totals=totals,\n        )\n        if a.entropy_coeff",
        ONE_RANK,
    ),
    (
        "metrics averaged over micro-batches",
        "rl_megatron/trainer/step_metrics.py",
        "sums = values.sum(dim=1).to(device)",
        "sums = values.mean(dim=1).to(device)",
        ONE_RANK,
    ),
    (
        "norms weight-decayed",
        ROLES,
        'weight_decay * group.get("wd_mult", 1.0)',
        "weight_decay",
        ONE_RANK,
    ),
    (
        "temperature ignored in training",
        "rl_megatron/trainer/build.py",
        "temperature = config.rollout.temperature or 1.0",
        "temperature = 1.0",
        ONE_RANK,
    ),
    (
        "loss not scaled by the DP size",
        ROLES,
        "scale = self.groups.dp_size * len(micro)",
        "scale = len(micro)",
        TP_DP,
    ),
    (
        "advantages whitened per DP rank",
        TRAINER,
        "            group=self.dp_group,\n        )\n\n        # 4. Update",
        "            group=None,\n        )\n\n        # 4. Update",
        TP_DP,
    ),
    (
        "a non-finite loss on another rank ignored",
        "rl_megatron/trainer/optimizer_step.py",
        "dist.all_reduce(first_bad, op=dist.ReduceOp.MIN, group=group)",
        "pass",
        NONFINITE,
    ),
    (
        "non-finite steps taken anyway",
        "rl_megatron/trainer/optimizer_step.py",
        "    if bad_rank < dist.get_world_size():\n",
        "    if False:\n",
        NONFINITE,
    ),
]


def run(name: str, path: str, old: str, new: str, test: str, workdir: Path) -> bool:
    copy = workdir / "repo"
    shutil.rmtree(copy, ignore_errors=True)
    ignore = shutil.ignore_patterns(".venv", ".git", "runs", "build", "__pycache__", ".*_cache")
    shutil.copytree(ROOT, copy, ignore=ignore)
    text = (copy / path).read_text()
    if text.count(old) != 1:
        print(f"STALE  {name}: the line to break is not in {path} exactly once", flush=True)
        return False
    (copy / path).write_text(text.replace(old, new))
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", test],
        cwd=copy,
        env={**os.environ, "PYTHONPATH": str(copy)},
        capture_output=True,
        text=True,
    )
    caught = result.returncode != 0
    print(f"{'CAUGHT' if caught else 'MISSED'} {name}  ({test})", flush=True)
    return caught


def main(words: list[str]) -> int:
    chosen = [m for m in MUTATIONS if not words or any(w in m[0] for w in words)]
    with tempfile.TemporaryDirectory() as workdir:
        results = [run(*m, Path(workdir)) for m in chosen]
    print(f"{sum(results)} of {len(results)} mutations caught")
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
