"""torchrun whose failed rendezvous is one line (what `launch/slurm/ppo.sbatch` runs per node).

    python launch/torchrun.py --nnodes 2 --nproc_per_node 8 --rdzv_backend c10d \
        --rdzv_endpoint HOST:PORT --rdzv_id JOB --rdzv_conf join_timeout=600 \
        launch/ppo.py --config yaml_configs/llama7b.yaml

The arguments are torchrun's, handed to `torch.distributed.run` unchanged; everything else
is torchrun's behaviour. When this node's agent cannot meet the others (nothing answers at
HOST:PORT, or not every node arrives within the join timeout), torchrun raises a
`RendezvousError` with a long traceback, and torch's C++ store client logs a stack trace for
every failed attempt. Here that is one line on stderr naming the node, the endpoint and
the timeout, and exit code 2, before any rank has started.
"""

from __future__ import annotations

import logging
import os
import socket
import sys

# Read once, when torch loads: quiets the store client's per-attempt C++ stack traces in
# this agent process only (its ranks get the user's setting back below).
_USER_CPP_LOG_LEVEL = os.environ.get("TORCH_CPP_LOG_LEVEL")
os.environ["TORCH_CPP_LOG_LEVEL"] = "FATAL"

from torch.distributed.elastic.rendezvous.api import RendezvousError  # noqa: E402
from torch.distributed.run import main as torchrun_main  # noqa: E402
from torch.distributed.run import parse_args  # noqa: E402

if _USER_CPP_LOG_LEVEL is None:
    del os.environ["TORCH_CPP_LOG_LEVEL"]
else:
    os.environ["TORCH_CPP_LOG_LEVEL"] = _USER_CPP_LOG_LEVEL

DEFAULT_JOIN_TIMEOUT_S = 600  # torch's default for --rdzv_conf join_timeout


class _DropShutdownRace(logging.Filter):
    """At the end of a run the agent hosting the store may exit first; the others then
    warn that they could not reach it to close the rendezvous. Nothing is wrong."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "failed to shutdown the rendezvous" not in record.getMessage()


logging.getLogger("torch.distributed.elastic.rendezvous.dynamic_rendezvous").addFilter(
    _DropShutdownRace()
)


def join_timeout(rdzv_conf: str) -> str:
    """The join timeout (seconds, as given) of a `--rdzv_conf key=value,...` string."""
    for item in rdzv_conf.split(","):
        key, _, value = item.partition("=")
        if key.strip() == "join_timeout":
            return value.strip()
    return str(DEFAULT_JOIN_TIMEOUT_S)


def describe(exc: BaseException) -> str:
    """The innermost cause's first line (the agent's own error says 'see inner exception')."""
    while exc.__cause__ is not None:
        exc = exc.__cause__
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    try:
        torchrun_main(argv)  # torchrun itself, error files and all
    except RendezvousError as exc:
        print(
            f"error: node {socket.gethostname()}: no rendezvous with the other nodes at "
            f"{args.rdzv_endpoint} within join_timeout={join_timeout(args.rdzv_conf)} s "
            f"({describe(exc)}); check that every node started and can reach that address",
            file=sys.stderr,
            flush=True,
        )
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
