"""`--deterministic` on the GPU across prefill-decode disaggregation, over cuda_ipc and tcp: four
requests at once through a PD stack (prefill in 64-token chunks beside the others, the first token
sampled on prefill, the rest decoded together from graphs) give the very text and logprobs that
a single server in the mode gives each alone, seeded sampling and greedy. smollm2-135m and
dsv4-tiny with dummy weights in bf16 and SmolLM2's tokenizer (.whl/tokenizer-smollm2, as
test_pd_cuda_ipc.py)."""

from __future__ import annotations

import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from conftest import GPU_FULL, smollm2_tokenizer_args

sys.path.insert(0, str(Path(__file__).parents[1] / "disagg"))
from openai_calls import client  # noqa: E402
from pd_stack import metrics, single_beside_pd  # noqa: E402

pytestmark = pytest.mark.gpu

GPU = ("--device", "cuda", "--dtype", "bfloat16", "--deterministic", "--max-total-tokens", "8192")
STORY = "The keeper climbed the stairs each evening and wrote the weather in his notebook. "
PROMPTS = ["The capital of France is", STORY * 6 + "The next morning", "1, 2, 3, 4,", STORY * 2]


def ask(url: str, name: str, i: int) -> tuple[str, list[float]]:
    r = client(url).completions.create(
        model=name, prompt=PROMPTS[i], max_tokens=8, temperature=float(i % 2 == 0),
        seed=40 + i, logprobs=1,
    )  # fmt: skip
    return r.choices[0].text, r.choices[0].logprobs.token_logprobs


@pytest.mark.parametrize(
    "name,backend",
    [
        ("smollm2-135m", "cuda_ipc"),
        pytest.param("smollm2-135m", "tcp", marks=GPU_FULL),
        ("dsv4-tiny", "cuda_ipc"),  # SmolLM2's vocabulary size: its tokenizer serves it
    ],
)
def test_pd_in_the_mode_equals_a_single_server_alone(name: str, backend: str) -> None:
    tokenizer = smollm2_tokenizer_args()
    if tokenizer is None:
        pytest.skip("no SmolLM2 tokenizer: run scripts/gpu_wheels.sh (.whl/tokenizer-smollm2)")
    model = ("--model", name, "--load-format", "dummy", *tokenizer)
    side = (*GPU, "--transfer-backend", backend)
    single, pd = single_beside_pd(model, (*GPU, "--max-num-batched-tokens", "64"), side)
    try:
        alone = [ask(single.url, name, i) for i in range(len(PROMPTS))]
        with ThreadPoolExecutor(len(PROMPTS)) as ex:
            through = list(ex.map(lambda i: ask(pd.router.url, name, i), range(len(PROMPTS))))
        for i, (want, got) in enumerate(zip(alone, through, strict=True)):
            assert got == want, f"prompt {i}: PD {got} vs single alone {want}"
        pd.wait_idle()
        sent = metrics(pd.prefill.url)
        assert sent[f'kvrelay_pd_transfer_bytes_total{{backend="{backend}",direction="sent"}}'] > 0
    finally:
        pd.close()
        single.close()
