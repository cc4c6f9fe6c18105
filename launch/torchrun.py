"""torchrun, as `launch/slurm/ppo.sbatch` runs it per node: `rl_megatron.launcher`.

    python launch/torchrun.py --nnodes 2 --nproc_per_node 8 --rdzv_backend c10d \
        --rdzv_endpoint HOST:PORT --rdzv_id JOB --rdzv_conf join_timeout=600 \
        launch/ppo.py --config yaml_configs/llama7b.yaml

The arguments are torchrun's. A failed rendezvous is one line naming the node, the endpoint
and the timeout (exit code 2, before any rank started); a rank's one-line refusal keeps its
line and exit code 2 instead of torchrun's ChildFailedError report (`rl_megatron/launcher.py`,
installed as `rl-megatron-run`).
"""

from __future__ import annotations

import sys

from rl_megatron.launcher import main

if __name__ == "__main__":
    sys.exit(main())
