"""Answers each request with the worker's CPU settings as it sees them (tests of worker/cpu.py)."""

import json
import os

import torch  # at import: the worker counts in the server's CPU budget once ready


def handle(data, context):
    if data is None:
        return None
    settings = {"threads": torch.get_num_threads(), "policy": os.environ.get("OMP_WAIT_POLICY"),
                "affinity": sorted(os.sched_getaffinity(0))}
    return [json.dumps(settings) for _ in data]
