"""Localises a device-side assert in graphed MTP chains (tests/gpu/test_dsv4_spec_graphs_gpu.py
[mtp3]): the graphed engine with every graph replay followed by a synchronize, and the eager
MTP pass on the graph's buffers instead of its graph (ONE=eager|graph|capture-only).

    python3 scripts/dev_mtp_chain_graph.py
"""

from __future__ import annotations

import os
import sys
import traceback

import torch

sys.path[:0] = ["tests", "tests/gpu"]
import test_dsv4_spec_graphs_gpu as t  # noqa: E402

from kvrelay.models.deepseek_v4.graphs import Dsv4GraphRunner  # noqa: E402

mode = os.environ.get("ONE", "graph")
orig_replay, orig_mtp = Dsv4GraphRunner._replay, Dsv4GraphRunner._replay_mtp


def replay(self, bs, ctx, q):
    got = orig_replay(self, bs, ctx, q)
    torch.cuda.synchronize()
    return got


def replay_mtp(self, bs, ctx, q):
    if mode == "eager":
        out = self._mtp_forward(bs, q, self.graphs[(bs, ctx, q)])
    else:
        out = orig_mtp(self, bs, ctx, q)
    torch.cuda.synchronize()
    return out


Dsv4GraphRunner._replay, Dsv4GraphRunner._replay_mtp = replay, replay_mtp
eng = t._engine("mtp3", graphs=True)
torch.cuda.synchronize()
print("engine up (warm-up captures done)", sorted(eng.runner.graphs.graphs), flush=True)
prompts = t._prompts(eng.runner.model_cfg.vocab_size)
try:
    got = t._run(eng, prompts)
    torch.cuda.synchronize()
    print("ran:", [len(x) for x in got[0]])
except Exception:
    traceback.print_exc()
