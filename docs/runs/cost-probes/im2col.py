# Probe (docs/cost.md), run from the repository root: python docs/runs/cost-probes/im2col.py
# One reconstruction step of the CNN with nn.Conv2d, and with each convolution
# rewritten as patches times a weight matrix, in two ways.
import sys, time, torch, torch.nn as nn, torch.nn.functional as F
sys.path.insert(0, '.')
import models, recl
import experiments as benchmark  # benchmark.py until the reorganisation


class UnfoldBatched(nn.Module):
    """F.unfold, then one product per image: weight [o, c*k*k] @ patches [n, c*k*k, L]."""
    def __init__(self, conv):
        super().__init__()
        self.weight, self.bias, self.s, self.k = conv.weight, conv.bias, conv.stride[0], conv.kernel_size[0]

    def forward(self, x):
        n, _, h, w = x.shape
        oh, ow = (h - self.k) // self.s + 1, (w - self.k) // self.s + 1
        out = self.weight.flatten(1) @ F.unfold(x, self.k, stride=self.s)
        if self.bias is not None:
            out = out + self.bias[:, None]
        return out.view(n, -1, oh, ow)


class SlicesOneProduct(nn.Module):
    """Patches from k*k strided slices, channels last, then one 2D product for the whole batch."""
    def __init__(self, conv):
        super().__init__()
        self.weight, self.bias, self.s, self.k = conv.weight, conv.bias, conv.stride[0], conv.kernel_size[0]

    def forward(self, x):
        n, _, h, w = x.shape
        k, s = self.k, self.s
        oh, ow = (h - k) // s + 1, (w - k) // s + 1
        xl = x.permute(0, 2, 3, 1)
        patches = torch.cat([xl[:, i:i + s * (oh - 1) + 1:s, j:j + s * (ow - 1) + 1:s, :]
                             for i in range(k) for j in range(k)], dim=3)
        out = patches.reshape(n * oh * ow, -1) @ self.weight.permute(0, 2, 3, 1).reshape(len(self.weight), -1).t()
        if self.bias is not None:
            out = out + self.bias
        return out.view(n, oh, ow, -1).permute(0, 3, 1, 2)


def with_convs_as(net, form):
    for parent in list(net.modules()):
        for name, child in parent.named_children():
            if isinstance(child, nn.Conv2d):
                setattr(parent, name, form(child))
    return net


torch.set_num_threads(2)
for m in (200, 800):
    model = benchmark.trained_looking("cnn", (3, 32, 32), 10, torch.device("cpu"))
    for name, form in (("nn.Conv2d", None), ("unfold, batched", UnfoldBatched), ("slices, one 2D", SlicesOneProduct)):
        net = models.with_smooth_relu(model, 100.).eval()
        if form:
            with_convs_as(net, form)
        params = {k: v.detach() for k, v in net.named_parameters()}
        target, scale = recl.reconstruction_target(params, models.start_weights(model), "displacement")
        labels = torch.arange(10).repeat_interleave(m // 10)
        torch.manual_seed(0)
        x = (1e-3 * torch.randn(len(labels), 3, 32, 32)).requires_grad_()
        lam = torch.rand(len(labels)).requires_grad_()

        def step():
            loss = sum(benchmark.eq6_losses(net, params, target, scale, x, labels, lam, 0.05).values())
            loss.backward()
            grad_norm = x.grad.norm().item()
            x.grad = lam.grad = None
            return loss.item(), grad_norm

        loss, grad_norm = step()
        times = []
        for _ in range(3):
            start = time.perf_counter()
            step()
            times.append(time.perf_counter() - start)
        print(f"m {m} {name}: {min(times):.3f} s (loss {loss:.8g}, candidate gradient norm {grad_norm:.8g})", flush=True)
