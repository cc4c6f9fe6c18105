"""rl_megatron's torchrun entry point.

    torchrun --nproc_per_node 8 launch/ppo.py --config yaml_configs/llama7b.yaml \
        actor.optim.lr=1e-6 parallel.tp=4

Bad input (config, data, checkpoint, reward function) prints one line and exits with code
2 (no traceback); `--dry-run` resolves and validates the config, initialises the process
groups, prints the rank layout and the planned generation layout, and exits 0. Without it
the PPO/GRPO trainer runs (`rl_megatron/trainer/ppo_trainer.py`), resuming from the run
folder's newest checkpoint when there is one. A run folder that a live run holds is
refused (exit 2, naming the holder); under torchrun, ranks die with their launcher.
"""

from __future__ import annotations

import argparse
import sys

from rl_megatron.config import ConfigError, load_config, save_resolved, to_dict
from rl_megatron.config_checks import validate
from rl_megatron.distributed import (
    RendezvousError,
    distributed_run,
    exit_with_launcher,
    gather_rank_table,
    launch_env,
)
from rl_megatron.parallel import ParallelLayout
from rl_megatron.resharding.layouts import (
    GenerationLayout,
    format_layout_table,
    generation_layout_for,
    micro_dp,
)
from rl_megatron.rollout.engines import check_engine_config
from rl_megatron.utils import warning_filters
from rl_megatron.utils.console import print_line
from rl_megatron.utils.logging import format_config, get_logger
from rl_megatron.utils.run_lock import run_dir_lock


def user_errors() -> tuple[type[Exception], ...]:
    """Bad input the user can fix; anything else is a bug and keeps its traceback."""
    from rl_megatron.checkpoint.training_state import CheckpointError
    from rl_megatron.data.datasets import DataError
    from rl_megatron.models.hf_config import HFConfigError
    from rl_megatron.resharding.verify import SyncVerifyError
    from rl_megatron.rewards.registry import RewardError
    from rl_megatron.trainer.optimizer_step import NonFiniteUpdateError
    from rl_megatron.trainer.rollout_records import RecordWriteError
    from rl_megatron.utils.disk_space import DiskFullError

    # NonFiniteUpdateError is no bad input, but it is one line too: every rank stops at
    # the same optimizer step, and the traceback would only show the optimizer's call.
    return (
        ConfigError,
        DataError,
        HFConfigError,
        RewardError,
        CheckpointError,
        NonFiniteUpdateError,
        DiskFullError,  # a full disk: the run's own writes agree on it across ranks
        RecordWriteError,  # trainer.dump_rollouts' file could not be written (shared too)
        SyncVerifyError,  # the engine's weights differ from those sent (every rank agrees)
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="launch/ppo.py",
        description="Train an LLM with PPO/GRPO on Megatron-core (launch with torchrun).",
        epilog="Overrides are dotted keys, e.g. actor.optim.lr=1e-6 parallel.tp=2",
    )
    parser.add_argument("--config", required=True, help="YAML config (see yaml_configs/)")
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="validate, initialise process groups, print the layout, exit",
    )
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    exit_with_launcher()  # under torchrun: no rank outlives its launcher
    args = parse_args(argv)
    env = launch_env()
    from rl_megatron.models.hf_config import HFConfigError, resolve_model_config

    try:
        # model.* as the model is built (model.hf_path's config.json): what is printed
        # below and saved as config.resolved.yaml.
        config, replaced = resolve_model_config(load_config(args.config, args.overrides))
        layout = validate(config, env.world_size)
        check_engine_config(config)  # the chosen rollout engine's own checks
    except (ConfigError, HFConfigError) as exc:
        # Every rank sees the same config error; one line from rank 0 is enough.
        if env.rank == 0:
            print_line(f"config error: {exc}")
        return 2
    # Every rank filters the warning noise it raises itself (before megatron-core loads).
    warning_filters.install(config.logging.level)
    log = get_logger(env.rank, config.logging.level)
    for warning in replaced if env.rank == 0 else ():  # the same on every rank
        log.warning(warning)
    log.info("resolved config:\n%s", format_config(to_dict(config)))
    try:
        return _run(args, config, layout, env, log)
    except RendezvousError as exc:  # the ranks never met: one line per rank, no traceback
        print_line(f"error: {exc}")
        return 2


def _run(args: argparse.Namespace, config, layout: ParallelLayout, env, log) -> int:
    dry_run = args.dry_run or config.trainer.dry_run
    training_layout, world = layout, None
    if config.trainer.mode == "split_async":
        # The last placement.rollout_ranks ranks only generate, each side in a process
        # group of its own (rl_megatron/placement.py); from here on `env` is the side's.
        from rl_megatron.placement import generating_layout, init_split_world

        p = config.parallel
        world, _ = init_split_world(
            env, config.placement.rollout_ranks, p.timeout_s, p.rendezvous_timeout_s
        )
        if world.generates:
            layout = generating_layout(config.rollout.tp, world.rollout_ranks)
        env = launch_env()
    with distributed_run(
        layout,
        seed=config.trainer.seed,
        timeout_s=config.parallel.timeout_s,
        deterministic=config.trainer.deterministic,
        rendezvous_timeout_s=config.parallel.rendezvous_timeout_s,
    ) as run:
        run.split = world
        if world is not None and world.generates:
            return 0 if dry_run else _generate(config, run, training_layout, log)
        return _train(config, run, env, dry_run, log)


def _generate(config, run, training_layout: ParallelLayout, log) -> int:
    """A generation rank of split placement: its engine, then batches until the end."""
    from rl_megatron.trainer.split_rollouts import GenerationSide

    try:
        side = GenerationSide(config, run.split, run, training_layout, log)
        side.handshake()
        side.run()
    except user_errors() as exc:
        if run.env.rank == 0:
            print_line(f"error (generation ranks): {exc}")
        return 2
    return 0


def _train(config, run, env, dry_run: bool, log) -> int:
    with run_dir_lock(config.run_dir, log) as lock:
        # One run per run directory (utils/run_lock.py); every rank learns the refusal.
        if lock.refusal:
            if env.rank == 0:
                print_line(f"error: {lock.refusal}")
            return 2
        if run.layout.cp > 1:
            # The Megatron engine (config_checks refuses vLLM with cp): every CP rank
            # generates its replica's rows itself, its TP group a generation replica.
            generation = GenerationLayout(tp=config.rollout.tp, world_size=run.layout.world_size)
        else:
            generation = generation_layout_for(run.layout, config.rollout.tp)
        rows = gather_rank_table(run)
        full = _start_run_dir(config, log) if env.rank == 0 else None
        if _shared(full):  # every rank learns it: none waits in a later collective
            if env.rank == 0:
                print_line(f"error: {full}")
            return 2
        if env.rank == 0:
            print(format_layout_table(rows, generation))
            print(
                f"training layout: {run.layout.describe()}; "
                f"generation layout: tp={generation.tp} replicas={generation.replicas} "
                f"(micro-dp {micro_dp(run.layout, generation)} per training replica), "
                f"engine={config.rollout.engine}",
                flush=True,
            )
        if dry_run:
            return 0
        # Imported here: the trainer pulls in megatron-core, which `--help` and config
        # errors need not wait for.
        from rl_megatron.trainer.ppo_trainer import build_trainer

        try:
            trainer = build_trainer(config, run, log)
            trainer.fit()
        except user_errors() as exc:
            # Raised on every rank alike (inputs are read everywhere; reward failures are
            # shared before raising): one line from rank 0, nothing half-written.
            if env.rank == 0:
                print_line(f"error: {exc}")
            return 2
    return 0


def _start_run_dir(config, log) -> str | None:
    """Rank 0, under the lock: remove what interrupted saves left (a run that died of a
    full disk gets its space back first), then write config.resolved.yaml. Returns the
    full-disk line, or None."""
    from rl_megatron.trainer.checkpointing import remove_leftovers
    from rl_megatron.utils.disk_space import is_disk_full, no_space_line

    remove_leftovers(config.run_dir, log)
    try:
        save_resolved(config, config.run_dir)
    except OSError as exc:
        if not is_disk_full(exc):
            raise
        import yaml

        (config.run_dir / "config.resolved.tmp").unlink(missing_ok=True)
        needed = len(yaml.safe_dump(to_dict(config), sort_keys=False).encode())
        return no_space_line(config.run_dir / "config.resolved.yaml", needed)
    return None


def _shared(problem: str | None) -> str | None:
    """Rank 0's `problem`, on every rank (one broadcast)."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return problem
    box = [problem]
    dist.broadcast_object_list(box, src=0)
    return box[0]


if __name__ == "__main__":
    sys.exit(main())
