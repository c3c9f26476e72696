"""Peak memory (anonymous RSS, and RSS with the mapped checkpoint pages) and time of loading one TP=2 rank of a DeepSeek-V4 checkpoint: whole
then cut (`build_model` + `shard_model`) vs reading only the rank's slices (`load_rank`).

A dsv4-tiny widened to fat experts (hidden 512, 64 experts of 512) saved in the "hf" layout
(float32 experts: the tensors where the cut matters), each load in a fresh process.

    python benchmarks/dsv4_rank_load_memory.py [--out benchmarks/results/dsv4_rank_load_memory.json]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time

import torch

from kvrelay.models.deepseek_v4 import DeepseekV4ForCausalLM, init_dummy_weights, preset

CFG = preset("dsv4-tiny").with_(
    hidden_size=512, q_lora_rank=128, moe_intermediate_size=512, n_routed_experts=64
)


def _status_mib(key: str) -> float:
    with open("/proc/self/status") as f:
        line = next(x for x in f if x.startswith(key + ":"))
    return int(line.split()[1]) / 1024


class _AnonPeak:
    """Peak anonymous RSS (the process's own memory; the checkpoint's memory-mapped pages are
    page cache, counted in VmHWM but shared and reclaimable), polled every millisecond."""

    def __init__(self) -> None:
        self.peak, self._stop = _status_mib("RssAnon"), threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        while not self._stop.wait(0.001):
            self.peak = max(self.peak, _status_mib("RssAnon"))

    def stop(self) -> float:
        self._stop.set()
        self._thread.join()
        return max(self.peak, _status_mib("RssAnon"))


def _one(path: str, how: str) -> dict[str, float]:
    from kvrelay.layers.parallel import TPGroup
    from kvrelay.weights.dsv4_rank_load import load_rank
    from kvrelay.weights.dsv4_tp import shard_model
    from kvrelay.weights.loader import build_model, resolve

    src = resolve(path)
    before = _status_mib("RssAnon")
    anon = _AnonPeak()
    t0 = time.perf_counter()
    tp, ep = TPGroup(1, 2), how.endswith("+ep")
    if how.startswith("whole"):
        model = build_model(src, torch.float32, torch.device("cpu"))
        shard_model(model, tp, ep)
    else:
        model = load_rank(path, src.config, torch.float32, torch.device("cpu"), tp, ep)
    held = sum(t.numel() * t.element_size() for t in model.state_dict().values()) / 2**20
    seconds = time.perf_counter() - t0
    return {
        "seconds": seconds,
        "anon_rss_before_mib": before,
        "peak_anon_rss_mib": anon.stop(),
        "peak_rss_with_mapped_file_mib": _status_mib("VmHWM"),
        "rank_holds_mib": held,
    }


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "--one":
        print(json.dumps(_one(sys.argv[2], sys.argv[3])))
        return
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    args = ap.parse_args()
    from kvrelay.weights.dsv4_writer import save_dsv4_checkpoint

    with tempfile.TemporaryDirectory() as path:
        model = DeepseekV4ForCausalLM(CFG)
        init_dummy_weights(model, 0)
        whole = sum(t.numel() * t.element_size() for t in model.state_dict().values()) / 2**20
        save_dsv4_checkpoint(model, path, "hf", shards=2)
        del model
        rows = {"model_mib": whole}
        for how in ("whole+cut", "rank", "whole+cut+ep", "rank+ep"):
            out = subprocess.run(
                [sys.executable, __file__, "--one", path, how],
                check=True, capture_output=True, text=True,
            )  # fmt: skip
            rows[how] = json.loads(out.stdout.strip().splitlines()[-1])
    print(json.dumps(rows, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
