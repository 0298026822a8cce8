"""Fault injection for `parallelkit check`'s tests, loaded by every process of a launch whose PYTHONPATH starts with
this directory (Python imports `sitecustomize` at start-up) and acting only when PARALLELKIT_CHECK_FAULT is set:

    {"rank": 3, "never_join": true}            rank 3 sleeps instead of meeting the others
    {"rank": 2, "stall": "all_gather"}         rank 2 sleeps at its first all-gather
    {"rank": 1, "report": {"device": "..."}}   rank 1 reports these fields instead of its own

The sleeping ranks sleep far past any deadline: the check must end them (or its launcher must), not wait for them.
"""

import json
import os
import time

FAULT = json.loads(os.environ.get("PARALLELKIT_CHECK_FAULT", "null"))

if FAULT is not None:
    from parallelkit.check import live

    meet, run_collective, rank_report = live.meet, live.run_collective, live.rank_report

    def faulty_meet(host, port, rank, world, deadline):
        if FAULT.get("never_join") and rank == FAULT["rank"]:
            time.sleep(3600)
        return meet(host, port, rank, world, deadline)

    def faulty_collective(op, size, group, ranks, rank, device):
        if op == FAULT.get("stall") and rank == FAULT["rank"]:
            time.sleep(3600)
        return run_collective(op, size, group, ranks, rank, device)

    def faulty_report(rank, device):
        report = rank_report(rank, device)
        return {**report, **FAULT.get("report", {})} if rank == FAULT["rank"] else report

    live.meet, live.run_collective, live.rank_report = faulty_meet, faulty_collective, faulty_report
