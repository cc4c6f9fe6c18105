"""Rank-0 logging and the tables the launcher prints."""

from __future__ import annotations

import logging
import sys

import yaml


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
