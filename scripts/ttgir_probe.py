import sys, torch
sys.path.insert(0, "benchmarks")
from moe_kernel import make_experts, inputs
from kvrelay.kernels.triton_moe import fused_experts
from kvrelay.models.deepseek_v4 import preset
from kvrelay.models.deepseek_v4.experts import Experts
ex = make_experts(256, 4096, 2048)
for t in (1, 64):
    x, w, idx = inputs(t, 256, 4096, 6, 1)[0]
    fused_experts(x, w, idx, ex)
cfg = preset("dsv4-mini").with_(n_routed_experts=16, hidden_size=4096, moe_intermediate_size=2048)
d = Experts(cfg, torch.bfloat16).cuda()
x, w, idx = inputs(64, 16, 4096, 6, 1)[0]
fused_experts(x, w, idx, d)
torch.cuda.synchronize()
