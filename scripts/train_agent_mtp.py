"""Train the MTP block of the tiny DeepSeek-V4 agent (../shared/models/dsv4-tiny-agent, whose
checkpoint has none) so speculative decoding is measured on real behaviour: the main model stays
frozen; the MTP block (a sliding-window block fed the main model's last streams at t and the
embedding of token t+1, `models/deepseek_v4/mtp.py`) learns token t+2 through the shared head,
on the agent's own training chats (its make_agent.py renders them).

The block starts as a copy of the main model's last block (the same kind: sliding, bias-routed
MoE), its final norm and hyper head as the main model's, e_proj and h_proj as identities.
Writes the block's tensors (kvrelay names, `model.mtp.0.*`, bf16) to OUT and prints, on chats
of another seed, how often the MTP's greedy token at t equals the main model's greedy token at
t + 1 (both predict token t + 2): the acceptance rate of one greedy draft token.

    .venv/bin/python scripts/train_agent_mtp.py tests/data/dsv4-tiny-agent-mtp.safetensors \
        [--steps 600] [--minutes 20]
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from transformers import AutoTokenizer

from kvrelay.weights.loader import build_dsv4, resolve

AGENT = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "models", "dsv4-tiny-agent")


def chats(tok, seed: int):
    """Token ids of the agent's training conversations (make_agent.conversation), forever."""
    sys.path.insert(0, AGENT)
    import make_agent  # noqa: PLC0415 (the agent's own generator, beside its weights)

    rng = random.Random(seed)
    while True:
        ids = tok(make_agent.conversation(rng), add_special_tokens=False).input_ids
        yield torch.tensor(ids[:1024], dtype=torch.long)


def init_from_last_block(model) -> None:
    m = model.model
    mtp = m.mtp[0]
    with torch.no_grad():
        mtp.load_state_dict(m.layers[-1].state_dict(), strict=False)
        mtp.norm.load_state_dict(m.norm.state_dict())
        mtp.hc_head.load_state_dict(m.hc_head.state_dict())
        for proj in (mtp.e_proj, mtp.h_proj):
            proj.weight.copy_(torch.eye(proj.weight.shape[0]))


def mtp_logits(model, ids: torch.Tensor, train: bool):
    """(MTP logits of rows 0..n-3 [n-2, V], the main model's logits [n, V])."""
    m = model.model
    with torch.no_grad():
        hidden, streams, _ = m(ids, model.new_state())
        main = model.compute_logits(hidden)
        nxt = m.embed_tokens(ids[1:-1])
    with torch.set_grad_enabled(train):
        h, _ = m.mtp[0].predict(streams[:-2], nxt, ids[1:-1], 0, model.new_mtp_state().layers[0])
        return model.compute_logits(h), main


def agreement(model, data, n: int) -> tuple[float, int]:
    """Share of positions where the MTP's argmax at t equals the main model's argmax at t + 1."""
    hits = total = 0
    for _ in range(n):
        ids = next(data)
        logits, main = mtp_logits(model, ids, train=False)
        hits += int((logits.argmax(-1) == main[1:-1].argmax(-1)).sum())
        total += logits.shape[0]
    return hits / total, total


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--minutes", type=float, default=20.0)
    p.add_argument("--batch", type=int, default=4, help="conversations per step")
    p.add_argument("--lr", type=float, default=1e-3)
    a = p.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(int(os.environ.get("THREADS", "1")))
    model = build_dsv4(resolve(AGENT), torch.float32, torch.device("cpu"), 0, 4096)
    for q in model.parameters():
        q.requires_grad_(False)
    init_from_last_block(model)
    params = list(model.model.mtp[0].parameters())
    for q in params:
        q.requires_grad_(True)
    tok = AutoTokenizer.from_pretrained(AGENT)
    train, held_out = chats(tok, 1), chats(tok, 12345)
    before, n_pos = agreement(model, held_out, 16)
    print(f"agreement before training: {before:.3f} over {n_pos} positions", flush=True)
    opt = torch.optim.AdamW(params, lr=a.lr, weight_decay=0.01, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.OneCycleLR(
        opt, max_lr=a.lr, total_steps=a.steps, pct_start=0.1
    )
    t0 = time.time()
    for step in range(a.steps):
        loss = 0.0
        for _ in range(a.batch):
            ids = next(train)
            logits, _ = mtp_logits(model, ids, train=True)
            loss = loss + F.cross_entropy(logits.float(), ids[2:]) / a.batch
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        if step % 25 == 0 or step == a.steps - 1:
            print(f"step {step} loss {loss.item():.4f} {time.time() - t0:.0f}s", flush=True)
        if time.time() - t0 > a.minutes * 60:
            print(f"stopped at step {step} (time)", flush=True)
            break
    after, n_pos = agreement(model, chats(tok, 12345), 16)
    print(f"agreement after training: {after:.3f} over {n_pos} positions", flush=True)
    tensors = {
        f"model.mtp.0.{k}": v.detach().to(torch.bfloat16).contiguous()
        for k, v in model.model.mtp[0].state_dict().items()
    }
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    save_file(tensors, a.out, metadata={"agreement_before": f"{before:.4f}",
                                        "agreement_after": f"{after:.4f}",
                                        "steps": str(step + 1)})  # fmt: skip
    print(f"wrote {len(tensors)} tensors to {a.out}")


if __name__ == "__main__":
    main()
