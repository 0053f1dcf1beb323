"""A follower rank's process of the offline engine (engine/dist/rank.py starts it):

    python -m pdserve.engine.dist.follower '<EngineArgs JSON>' '<ParallelConfig JSON>'

It loads the model, keeps its shard, joins the group and follows rank 0's steps until STOP;
it exits 1 on any failure (the leader's next collective then fails on the closed sockets).
"""
from __future__ import annotations

import json
import sys

from pdserve.engine.dist.config import ParallelConfig
from pdserve.engine.exec.heap import freeze_startup_heap


def follower_main(argv: list[str]) -> int:
    """A follower process: load, shard, join, follow until STOP; 1 on any failure (the
    leader's next collective fails on the closed sockets)."""
    from pdserve.kernels.triton_mode import select_triton_mode

    select_triton_mode()  # an entry point: before anything imports triton
    from pdserve.engine.dist.rank import engine_args_of
    from pdserve.engine.llm import load_rank

    cfg = ParallelConfig(**json.loads(argv[1]))
    try:
        args = engine_args_of(json.loads(argv[0]))
        if cfg.device == "cpu":  # the ranks share the host's cores
            import torch

            torch.set_num_threads(max(1, torch.get_num_threads() // cfg.tp_size))
        rank = load_rank(args, cfg)
        follower = None
        try:
            follower = rank.follower()  # captures its decode graphs with rank 0's
            rank.group.start_watchdog()  # then a deadline on their collectives
            freeze_startup_heap()  # a process of our own: full GC pauses out of the lockstep
            follower.run()  # with speculative, its MTP head shard drafts too
        finally:
            if follower is not None:
                # before the communicator goes (pytorch#115388)
                follower.graphs, follower.verify_graphs = None, {}
            rank.group.close()
    except BaseException as e:  # noqa: BLE001 - reported; the exit code says it failed
        print(f"pdserve tp rank {cfg.rank}: {type(e).__name__}: {e}", file=sys.stderr,
              flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(follower_main(sys.argv[1:]))
