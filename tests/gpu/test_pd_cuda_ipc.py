"""PD over the cuda_ipc backend, as real processes on one GPU: the authenticated handshake hands
prefill decode's cache tensors (typed CUDA IPC handles), prefill writes the KV straight into
decode's pages, and the answers equal a single server's."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from conftest import ServerProcess

sys.path.insert(0, str(Path(__file__).parents[1] / "disagg"))
from openai_calls import client  # noqa: E402
from pd_stack import PDStack, bootstrap_events, metrics  # noqa: E402

pytestmark = pytest.mark.gpu

GPU = ("--device", "cuda", "--dtype", "float32", "--max-total-tokens", "16384")
STORY = (
    "The old lighthouse keeper climbed the spiral stairs every evening, counting the steps, "
    "listening to the sea, and writing the weather into a leather notebook. "
)


@pytest.fixture(scope="module")
def stacks():
    ipc = (*GPU, "--transfer-backend", "cuda_ipc")
    # Prefill computes prompts in 64-token chunks: so does the single server.
    single = ServerProcess("--model", "smollm2", *GPU, "--max-num-batched-tokens", "64")
    try:
        pd = PDStack(prefill_args=ipc, decode_args=ipc)
    except BaseException:
        single.close()
        raise
    yield single, pd
    pd.close()
    single.close()


def test_pd_over_cuda_ipc_equals_a_single_server(stacks):
    single, pd = stacks
    for prompt in ("The capital of France is", STORY * 3, STORY * 9):
        kw = dict(model="smollm2", prompt=prompt, max_tokens=16, temperature=0)
        want = client(single.url).completions.create(**kw).choices[0]
        got = client(pd.router.url).completions.create(**kw).choices[0]
        assert (got.text, got.finish_reason) == (want.text, want.finish_reason), prompt[:40]
    pd.wait_idle()
    sent = metrics(pd.prefill.url)
    assert sent['kvrelay_pd_transfer_bytes_total{backend="cuda_ipc",direction="sent"}'] > 0
    assert sent.get('kvrelay_pd_transfer_bytes_total{backend="tcp",direction="sent"}', 0) == 0
    for side in (pd.prefill, pd.decode):
        events = bootstrap_events(side.url)
        assert events.get("peer_connected") == 1, events
        bad = ("ipc_open_failed", "peer_unauthenticated", "protocol_mismatch", "layout_mismatch")
        assert not any(events.get(e) for e in bad), events
