"""Networks for ReCL, whose theory (App. B.1) needs *homogeneous* ones: weights scaled by c scale the output by c^L, as
in ReLU nets without biases. As in App. D.1 only the first layer has a bias; no head has one, so it can grow."""
import importlib
import torch
import torch.nn as nn

class MLP(nn.Module):  # the paper's D-1000-1000-C perceptron
    def __init__(self, in_dim, n_classes, hidden=1000, first_init_scale=1e-4):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(in_dim, hidden), nn.Linear(hidden, hidden, bias=False)
        self.head, self.act1, self.act2 = nn.Linear(hidden, n_classes, bias=False), nn.ReLU(), nn.ReLU()
        for p in self.fc1.parameters():  # weight, then bias: N(0, scale^2), drawn after all default inits
            p.data.normal_().mul_(first_init_scale)

    def forward(self, x):
        return self.head(self.act2(self.fc2(self.act1(self.fc1(x.flatten(1))))))

def he_init(model):
    """He et al. (2015): weights N(0, 2 / fan_in), biases 0: a signal keeps its size through ReLU layers (PyTorch's
    default shrinks it ~sqrt(3) a layer: SGD would leave the CNN and AlexNet at the loss ln C)."""
    for module in [m for m in model.modules() if isinstance(m, (nn.Conv2d, nn.Linear))]:
        nn.init.kaiming_normal_(module.weight, nonlinearity="relu")
        if module.bias is not None:
            nn.init.zeros_(module.bias)

class CNN(nn.Module):  # the paper's (after Deng et al. 2021): two 3x3 convolutions of 160, stride 2, then 640-320-C
    def __init__(self, input_shape, n_classes, channels=160):
        super().__init__()
        (c, h, w), side = input_shape, lambda n: ((n - 3) // 2 + 1 - 3) // 2 + 1  # a side after both convolutions
        self.conv1, self.conv2 = nn.Conv2d(c, channels, 3, stride=2), nn.Conv2d(channels, channels, 3, 2, bias=False)
        self.fc1 = nn.Linear(channels * side(h) * side(w), 640, bias=False)
        self.fc2, self.head = nn.Linear(640, 320, bias=False), nn.Linear(320, n_classes, bias=False)
        self.act1, self.act2, self.act3, self.act4 = (nn.ReLU() for _ in range(4))
        he_init(self)

    def forward(self, x):
        x = self.act2(self.conv2(self.act1(self.conv1(x))))
        return self.head(self.act4(self.fc2(self.act3(self.fc1(x.flatten(1))))))

# Not homogeneous (biases, max-pooling, dropout, batch norm, skips): ReCL helps beyond its theory (Sec. 6.4, App. J).
class AlexNet(nn.Module):  # AlexNet-style: five 3x3 convolutions with max-pooling, two dropout dense layers
    def __init__(self, input_shape, n_classes):
        super().__init__()
        (c, h, w), conv = input_shape, lambda cin, cout: [nn.Conv2d(cin, cout, 3, padding=1), nn.ReLU()]
        self.features = nn.Sequential(*conv(c, 64), nn.MaxPool2d(2), *conv(64, 192), nn.MaxPool2d(2),
                                      *conv(192, 384), *conv(384, 256), *conv(256, 256), nn.MaxPool2d(2))
        self.dense = nn.Sequential(nn.Dropout(0.5), nn.Linear(256 * (h // 8) * (w // 8), 512), nn.ReLU(),
                                   nn.Dropout(0.5), nn.Linear(512, 512), nn.ReLU())
        self.head = nn.Linear(512, n_classes, bias=False)
        he_init(self)

    def forward(self, x):
        return self.head(self.dense(self.features(x).flatten(1)))

class ResNet18(nn.Module):  # torchvision's ResNet18 with the usual small-image stem (3x3 conv, no max-pool)
    def __init__(self, input_shape, n_classes):
        super().__init__()
        f = self.features = importlib.import_module("torchvision.models").resnet18()  # imported here: slow
        f.conv1, f.maxpool, f.fc = nn.Conv2d(input_shape[0], 64, 3, 1, 1, bias=False), nn.Identity(), nn.Identity()
        self.head = nn.Linear(512, n_classes, bias=False)

    def forward(self, x):
        return self.head(self.features(x))
MODELS = ["mlp", "cnn", "alexnet", "resnet18"]
# Smallest image side: 7 leaves 1x1 after the CNN's two stride-2 convolutions; 8 after 3 poolings or stride-2 stages
SMALLEST_SIDE = {"cnn": 7, "alexnet": 8, "resnet18": 8}

def build_model(name, input_shape, n_classes):  # a network of MODELS that remembers its start (theta_0)
    if name != "mlp" and (len(input_shape) != 3 or min(input_shape[1:]) < SMALLEST_SIDE[name]):
        raise ValueError(f"the {name} needs {SMALLEST_SIDE[name]} pixels a side or more, got {list(input_shape)}")
    return remember_start(MLP(int(torch.Size(input_shape).numel()), n_classes) if name == "mlp" else
                          {"cnn": CNN, "alexnet": AlexNet, "resnet18": ResNet18}[name](tuple(input_shape), n_classes))

def remember_start(model):  # theta_0, a copy of the weights now: for `--rec-target displacement` (theta - theta_0)
    model.start = {k: v.detach().clone() for k, v in model.named_parameters()}
    return model

def start_weights(model):  # theta_0, on the device of the weights; None if the model never remembered it
    return {k: model.start[k].to(p.device) for k, p in model.named_parameters()} if hasattr(model, "start") else None

def grow_head(model, n_classes):  # widen the output layer to n_classes, keeping the learned rows of old classes
    if n_classes == (old := model.head).out_features:
        return
    model.head = new = nn.Linear(old.in_features, n_classes, bias=False).to(old.weight.device)
    new.weight.data[:old.out_features] = old.weight.detach()
    if hasattr(model, "start"):  # the new rows start where they were initialised
        start = model.start["head.weight"]
        model.start["head.weight"] = torch.cat([start, new.weight[old.out_features:].detach().to(start.device)])

def step1_gib(net, input_shape, n):
    """About the memory Step 1 fills for n candidates in one pass, in GiB: each candidate and 4 copies of every layer's
    outputs for it (docs/cost.md)."""
    sizes = []  # the numbers each layer outputs for one image
    for layer in (m for m in net.modules() if not list(m.children())):
        layer.register_forward_hook(lambda m, i, out: sizes.append(out.numel()))
    with torch.no_grad():
        net.eval()(torch.zeros(1, *input_shape))
    return 4 * n * (input_shape.numel() + 4 * sum(sizes)) / 2 ** 30
