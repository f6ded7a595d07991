# Probe for docs/levers.md section J, run from the repository root at e57c1a2.
# python docs/runs/levers-j/adam_probe.py sgd|adam N_REC LR_X
"""Probe: does Adam on the candidates reach SGD's 100-step L_rec in fewer steps? (task 1, seed 0)"""
import sys, time, argparse, torch, torch.nn.functional as F
sys.path.insert(0, '.')
import data, models, recl
torch.set_num_threads(1)
opt_name, n_rec, lrx = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
tasks, _, mean_image = data.make_tasks("mnist", 0, 100, "cil", 2, "data")
t1 = tasks[0]
torch.manual_seed(0)
model = models.build_model("mlp", t1.x_train.shape[1:], 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
x, y = t1.x_train, t1.y_train
for e in range(20):
    perm = torch.randperm(len(x))
    for i in range(0, len(x), 64):
        b = perm[i:i+64]; opt.zero_grad(); F.cross_entropy(model(x[b]), y[b]).backward(); opt.step()
if opt_name == "adam":
    sgd = torch.optim.SGD
    calls = []
    def patched(params, lr, momentum):
        calls.append(1)
        return torch.optim.Adam(params, lr=lrx) if len(calls) == 1 else sgd(params, lr=lr, momentum=momentum)
    recl.torch.optim.SGD = patched
cfg = argparse.Namespace(alpha=100.0, rec_precision="float32", sigma_x=1e-3, seed=0, rec_target="displacement", lr_x=lrx, lr_lambda=0.1,
                         lambda_min=0.05, n_rec=n_rec)
labels = torch.arange(2).repeat_interleave(100)
start = time.time()
xr, lr_, lam, rep = recl.reconstruct(model, labels, x.shape[1:], cfg, log=lambda *a: None)
scores, _ = recl.reconstruction_quality(x, xr, mean_image)
print(f"{opt_name} n_rec {n_rec} lr_x {lrx}: rel L_rec {rep['last_l_rec']:.4f} SSIM {scores.mean():.3f} "
      f"|x| {xr.abs().mean():.3g} ({time.time()-start:.0f}s)", flush=True)
