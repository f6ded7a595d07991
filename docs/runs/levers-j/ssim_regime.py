# Probe for docs/levers.md section J, run from the repository root at e57c1a2.
# python docs/runs/levers-j/ssim_regime.py EPOCHS N_REC LR full|mb WEIGHT_DECAY TARGET M_PER_CLASS LR_X|- N_PER_CLASS
"""Probe: does SSIM reach 0.3 when task 1 is trained to convergence and reconstructed longer?"""
import sys, time, argparse, torch, torch.nn.functional as F
sys.path.insert(0, '.')
import data, models, recl
torch.set_num_threads(1)
epochs, n_rec, lr, full = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]), sys.argv[4] == "full"
wd = float(sys.argv[5]) if len(sys.argv) > 5 else 0.0
target = sys.argv[6] if len(sys.argv) > 6 else "displacement"
mper = int(sys.argv[7]) if len(sys.argv) > 7 else 100
lrx = float(sys.argv[8]) if len(sys.argv) > 8 and sys.argv[8] != "-" else recl.DEFAULT_LR_X[target]
npc = int(sys.argv[9]) if len(sys.argv) > 9 else 100
tasks, _, mean_image = data.make_tasks("mnist", 0, npc, "cil", 2, "data")
t1 = tasks[0]
torch.manual_seed(0)
model = models.build_model("mlp", t1.x_train.shape[1:], 2)
opt = torch.optim.SGD(model.parameters(), lr=lr, weight_decay=wd)
x, y = t1.x_train, t1.y_train
start = time.time()
for e in range(epochs):
    if full:
        opt.zero_grad(); loss = F.cross_entropy(model(x), y); loss.backward(); opt.step()
    else:
        perm = torch.randperm(len(x))
        for i in range(0, len(x), 64):
            b = perm[i:i+64]; opt.zero_grad(); loss = F.cross_entropy(model(x[b]), y[b]); loss.backward(); opt.step()
with torch.no_grad():
    loss = F.cross_entropy(model(x), y).item(); acc = (model(t1.x_test).argmax(1) == t1.y_test).float().mean().item()
cfg = argparse.Namespace(alpha=100.0, rec_precision="float32", sigma_x=1e-3, seed=0, rec_target=target, lr_x=lrx, lr_lambda=0.1,
                         lambda_min=0.05, n_rec=n_rec)
labels = torch.arange(2).repeat_interleave(mper)
xr, lr_, lam, rep = recl.reconstruct(model, labels, x.shape[1:], cfg, log=lambda *a: None)
scores, _ = recl.reconstruction_quality(x, xr, mean_image)
print(f"epochs {epochs} n_rec {n_rec} lr {lr} {'full' if full else 'mb'} wd {wd} {target} m {mper} lrx {lrx} n/class {npc}: train loss {loss:.2e} test acc {acc:.3f} "
      f"rel L_rec {rep['last_l_rec']:.3f} SSIM {scores.mean():.3f} >0.4 {(scores > 0.4).float().mean():.3f} ({time.time()-start:.0f}s)", flush=True)
