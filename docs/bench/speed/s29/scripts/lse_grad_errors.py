"""Errors of dq / dk / dv with a weighted lse gradient (tests/test_kernels_gpu.py's
test_an_lse_gradient_after_a_call_without_one_on_the_same_layout) over several seeds: ours and
PyTorch's bf16 against float64, as max-abs and relative Frobenius errors, and the same with
the lse term left out of ours (what the test must catch).

python lse_grad_errors.py SEED [SEED ...]
"""
import sys

import torch

from hf_hilbert_attn import DilatedPattern, dilated_attention, reference_attention

P = DilatedPattern([256, 512, 1024, 2048, 4096], [1, 2, 4, 6, 12])
for seed in (int(x) for x in sys.argv[1:]):
    torch.manual_seed(seed)
    s = 1025
    q = torch.randn(1, 4, s, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(1, 2, s, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    g, gl = torch.randn_like(q).double(), 10 * torch.randn(1, 4, s, device="cuda").double()

    def grads(fn, dtype, lse_too):
        ins = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
        o, lse = fn(*ins, P, return_lse=True)
        loss = (o.double() * g).sum() + ((lse.double() * gl).sum() if lse_too else 0)
        return torch.autograd.grad(loss, ins)

    grads(dilated_attention, torch.bfloat16, False)
    ours = grads(dilated_attention, torch.bfloat16, True)
    truth = grads(reference_attention, torch.float64, True)
    base = grads(reference_attention, torch.bfloat16, True)
    without = grads(dilated_attention, torch.bfloat16, False)
    line = [f"seed {seed}:"]
    for name, o, t, b, w in zip(("dq", "dk", "dv"), ours, truth, base, without):
        mx = [(x.double() - t).abs().max().item() for x in (o, b, w)]
        fr = [((x.double() - t).norm() / t.norm()).item() for x in (o, b, w)]
        line.append(f"{name} max {mx[0] / mx[1]:.2f}x (lse left out {mx[2] / mx[1]:.0f}x) "
                    f"frob {fr[0] / fr[1]:.2f}x ({fr[2] / fr[1]:.0f}x)")
    print("  ".join(line), flush=True)
