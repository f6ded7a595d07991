# Probe (docs/cost.md), run from the repository root at e57c1a2: python docs/runs/cost-probes/im2col_matmul.py
import sys, time, torch, torch.nn as nn, torch.nn.functional as F
sys.path.insert(0, '.')
import models, recl, benchmark

class UnfoldConv(nn.Module):
    """2D matmul form: rows are (image, output position), columns input patches."""
    def __init__(self, conv):
        super().__init__()
        self.weight, self.bias = conv.weight, conv.bias
        self.stride, self.k = conv.stride[0], conv.kernel_size[0]
    def forward(self, x):
        n, c, h, w = x.shape
        k, s = self.k, self.stride
        oh, ow = (h - k) // s + 1, (w - k) // s + 1
        # patches via strided slices, channels last: (n, oh, ow, k*k*c)
        xl = x.permute(0, 2, 3, 1)
        patches = torch.cat([xl[:, i:i + s * (oh - 1) + 1:s, j:j + s * (ow - 1) + 1:s, :]
                             for i in range(k) for j in range(k)], dim=3)
        wmat = self.weight.permute(0, 2, 3, 1).reshape(self.weight.shape[0], -1)  # o, (i j c)
        out = patches.reshape(n * oh * ow, -1) @ wmat.t()
        if self.bias is not None:
            out = out + self.bias
        return out.view(n, oh, ow, -1).permute(0, 3, 1, 2)

def swap(net):
    for parent in net.modules():
        for name, child in parent.named_children():
            if isinstance(child, nn.Conv2d):
                setattr(parent, name, UnfoldConv(child))
    return net

torch.set_num_threads(2)
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
        print(m, mode, f"{min(ts):.3f}s loss {v:.8g} gnorm {g.norm():.8g}", flush=True)
