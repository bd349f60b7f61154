"""A training script's save hook, as the API docs show it: the script started its own gloo process group, then
converts the checkpoint it just saved with merger.merge over that group, and goes on using the group.

Run under torchrun: python -m torch.distributed.run --nproc_per_node N tests/helpers/api_in_trainer.py ACTOR TARGET.
Each rank prints one JSON line: the merge's summary, what a bad call raised, and whether the group, the logging
handlers, the signal handlers and torch's thread count are still as the script left them.
"""
import json
import logging
import os
import signal
import sys

import torch
import torch.distributed as dist

import merger

if __name__ == "__main__":
    actor, target = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    before = (logging.getLogger().handlers[:], logging.getLogger("merger").handlers[:],
              signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT), torch.get_num_threads())
    summary = merger.merge(local_dir=actor, target_dir=target, dtype="fp32")
    try:
        merger.merge(local_dir=actor + "-missing", target_dir=target + "-2")
        raised = None
    except merger.MergerError as e:
        raised = str(e)
    after = (logging.getLogger().handlers[:], logging.getLogger("merger").handlers[:],
             signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT), torch.get_num_threads())
    total = torch.ones(1)
    dist.all_reduce(total)  # the script's group still works
    report = {"rank": dist.get_rank(), "status": summary["status"], "world": summary["merge_world_size"],
              "raised": raised, "group_sum": total.item(), "unchanged": before == after}
    os.write(1, (json.dumps(report) + "\n").encode())  # one write: the ranks share torchrun's stdout
    dist.destroy_process_group()
