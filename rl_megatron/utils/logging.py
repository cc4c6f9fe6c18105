"""Rank-0 logging and the tables the launcher prints."""

from __future__ import annotations

import logging
import sys

import yaml

from rl_megatron.resharding.layouts import GenerationLayout


def get_logger(rank: int, level: str = "INFO") -> logging.Logger:
    """`rl_megatron` logger that prints on rank 0 only (warnings and errors on every rank)."""
    logger = logging.getLogger("rl_megatron")
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stdout)
        handler.setFormatter(
            logging.Formatter("[%(asctime)s %(levelname)s] %(message)s", "%H:%M:%S")
        )
        logger.addHandler(handler)
        logger.propagate = False
    logger.setLevel(level if rank == 0 else "WARNING")
    return logger


def format_config(config: dict) -> str:
    return yaml.safe_dump(config, sort_keys=False).rstrip()


def format_layout_table(rows: list[dict], generation: GenerationLayout) -> str:
    """One line per rank: node, training coordinates, generation coordinates."""
    header = f"{'rank':>5} {'node':<20} {'tp':>3} {'pp':>3} {'dp':>3} {'cp':>3} | {'gen_tp':>6} {'gen_dp':>6}"
    lines = [header, "-" * len(header)]
    for row in sorted(rows, key=lambda r: r["rank"]):
        gen = generation.coordinates(row["rank"])
        lines.append(
            f"{row['rank']:>5} {row['node'][:20]:<20} {row['tp']:>3} {row['pp']:>3} "
            f"{row['dp']:>3} {row['cp']:>3} | {gen['gen_tp']:>6} {gen['gen_dp']:>6}"
        )
    return "\n".join(lines)
