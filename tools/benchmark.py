"""What ReCL costs: the seconds of one reconstruction step (Eq. 3-5 and their backward) for the MLP
(1x28x28) and the CNN (3x32x32) at m = 200 and 800. End to end, `python recl.py --method finetune` prints each
run's seconds, its JSON the reconstruction's ("phase_seconds"). Usage: python tools/benchmark.py [--device cuda]"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import config  # noqa: E402
import models  # noqa: E402
import recl  # noqa: E402


def reconstruction_step(name, input_shape, m, device):
    """Seconds (mean of 5) of one float32 step of step 1 for m candidates over 10 classes."""
    torch.manual_seed(0)
    model = models.build_model(name, input_shape, 10).to(device)
    with torch.no_grad():  # weights moved from their start, as after training
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    net = models.with_smooth_relu(model, 100.0).eval()
    params = {k: v.detach() for k, v in net.named_parameters()}
    target, scale = recl.displacement_target(params, model)
    labels = torch.arange(10, device=device).repeat_interleave(m // 10)
    x = (1e-3 * torch.randn(len(labels), *input_shape, device=device)).requires_grad_()
    lam = torch.rand(len(labels), device=device).requires_grad_()
    L = recl.stationarity_loss(net, params, labels, target, 0.05, None, scale)
    sum(L(x, lam).values()).backward()  # forward, backward and double backward, once to warm up
    from torch.utils.benchmark import Timer  # here: importing it can print a CUDA warning
    timer = Timer("sum(L(x, lam).values()).backward()", globals=locals(), num_threads=torch.get_num_threads())
    return {"model": name, "m": m, "seconds": timer.timeit(5).mean}  # it waits for the GPU


def main():
    p = config.Parser(prog="benchmark.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"])
    p.add_argument("--out", help="JSON file (default: results/benchmark-DEVICE.json)")
    args = p.parse_args()
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    out = Path(args.out or f"results/benchmark-{device.type}.json")
    config.check_writable(out.parent)
    result = {"machine": config.provenance(), "steps": []}
    for name, shape in (("mlp", (1, 28, 28)), ("cnn", (3, 32, 32))):
        for m in (200, 800):
            result["steps"].append(r := reconstruction_step(name, shape, m, device))
            print(f"{name}, m = {m}: {r['seconds']:.3f} s per step")
    config.write_json_atomically(out, result)
    print(f"-> {out}")


if __name__ == "__main__":
    config.run_from_command_line(main, "benchmark.py")
