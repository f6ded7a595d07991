# Probe (docs/cost.md), run from the repository root at e57c1a2: python docs/runs/cost-probes/im2col_bmm.py
import sys, time, torch, torch.nn as nn, torch.nn.functional as F
sys.path.insert(0, '.')
import models, recl, benchmark, argparse

class UnfoldConv(nn.Module):
    def __init__(self, conv):
        super().__init__()
        self.weight = conv.weight
        self.bias = conv.bias
        self.stride, self.k = conv.stride, conv.kernel_size
    def forward(self, x):
        n, c, h, w = x.shape
        cols = F.unfold(x, self.k, stride=self.stride)            # n, c*k*k, L
        oh = (h - self.k[0]) // self.stride[0] + 1; ow = (w - self.k[1]) // self.stride[1] + 1
        out = self.weight.flatten(1) @ cols                       # n, o, L
        if self.bias is not None:
            out = out + self.bias[:, None]
        return out.view(n, -1, oh, ow)

def swap(net):
    for parent in net.modules():
        for name, child in parent.named_children():
            if isinstance(child, nn.Conv2d):
                setattr(parent, name, UnfoldConv(child))
    return net

torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 2)
for m in (200, 800):
    model = benchmark.trained_looking("cnn", (3, 32, 32), 10, torch.device("cpu"))
    for mode in ("conv", "unfold"):
        net = models.with_smooth_relu(model, 100.).eval()
        if mode == "unfold": swap(net)
        params = {k: v.detach() for k, v in net.named_parameters()}
        target, scale = recl.reconstruction_target(params, models.start_weights(model), "displacement")
        labels = torch.arange(10).repeat_interleave(m // 10)
        torch.manual_seed(0)
        x = (1e-3 * torch.randn(len(labels), 3, 32, 32)).requires_grad_()
        lam = torch.rand(len(labels)).requires_grad_()
        def step():
            l = recl.reconstruction_losses(net, params, target, scale, x, labels, lam, 0.05)
            s = sum(l); s.backward(); g = x.grad.clone(); x.grad = lam.grad = None; return s.item(), g
        v, g = step()
        ts = []
        for _ in range(3):
            t = time.perf_counter(); step(); ts.append(time.perf_counter() - t)
        print(m, mode, f"{min(ts):.3f}s loss {v:.6g} gnorm {g.norm():.6g}", flush=True)
