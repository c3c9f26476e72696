"""Which source lines of the DeepSeek-V4 fast path launch the small torch kernels of a decode step:
one step run eagerly under a dispatch mode that records every kernel-launching aten op with the
innermost kvrelay frame that called it. The compiled glue (`@fusable`) runs eagerly here so that
its ops land on their own lines (rope.py, mhc.py, moe.py, qat.py): in a real step each such
function is one or two fused kernels. Triton kernels are not aten ops and are not counted.

    python benchmarks/dsv4_launch_sources.py [--model dsv4-mini --batch 1 --context 4096]
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import traceback

import torch
from dsv4_decode import fake_requests, make_engine, randomize_pools, sync
from torch.utils._python_dispatch import TorchDispatchMode

import kvrelay.models.deepseek_v4.batched as batched
from kvrelay.engine.scheduler import ScheduledRequest

NO_KERNEL = {
    "view", "_unsafe_view", "reshape", "select", "slice", "unsqueeze", "squeeze", "expand",
    "as_strided", "permute", "t", "transpose", "detach", "alias", "split", "unflatten", "flatten",
    "lift_fresh", "empty", "empty_strided", "empty_like", "split_with_sizes", "unbind", "chunk",
    "_reshape_alias", "narrow", "diagonal", "size", "sym_size", "is_same_size",
}  # fmt: skip
MAYBE_VIEW = {"to", "contiguous", "reshape", "type_as"}  # a kernel only when they copy


class LaunchSources(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        out = func(*args, **(kwargs or {}))
        same = (
            isinstance(out, torch.Tensor)
            and isinstance(args[0], torch.Tensor)
            and out.data_ptr() == args[0].data_ptr()
        )
        if name not in NO_KERNEL and not (name in MAYBE_VIEW and same):
            self.count[(name, _caller())] += 1
        return out


def _caller() -> str:
    frames = [f for f in traceback.extract_stack()[:-2] if "/kvrelay/" in f.filename]
    return f"{frames[-1].filename.split('/kvrelay/')[-1]}:{frames[-1].lineno}" if frames else "?"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="dsv4-mini")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--top", type=int, default=70)
    a = p.parse_args()
    a.batches, a.contexts, a.prefill = [a.batch], [a.context], 256
    engine = make_engine(a, "auto")
    randomize_pools(engine)
    reqs, _ = fake_requests(engine, a.batch, a.context)
    sched = [ScheduledRequest(q, 1) for q in reqs]
    engine.runner.graphs = None
    batched.fused_glue = lambda enabled=True: contextlib.nullcontext()
    engine.runner.forward(sched)
    sync(a.device)
    mode = LaunchSources()
    with mode:
        engine.runner.forward(sched)
    sync(a.device)
    by_file: collections.Counter = collections.Counter()
    for (_, where), n in mode.count.items():
        by_file[where.split(":")[0]] += n
    print(f"aten ops that launch kernels: {sum(mode.count.values())} per step")
    for f, n in by_file.most_common(25):
        print(f"  {n:5d}  {f}")
    for (name, where), n in mode.count.most_common(a.top):
        print(f"{n:5d} {name:24s} {where}")


if __name__ == "__main__":
    main()
