"""Networks for ReCL. Its theory (App. B.1) needs *homogeneous* networks: scaling the weights by c scales the output
by c^L, as in ReLU nets without biases. As in the paper (App. D.1), only the first layer has a bias; the MLP's starts
at a tiny scale, the CNN at He scale (chosen on validation: docs/running.md, "Other models")."""
import copy

import torch
import torch.nn as nn


class MLP(nn.Module):
    """The paper's D-1000-1000-C perceptron; `head` grows in class-incremental learning."""

    def __init__(self, in_dim, n_classes, hidden=1000, first_init_scale=1e-4):
        super().__init__()
        self.fc1 = nn.Linear(in_dim, hidden)
        self.fc2 = nn.Linear(hidden, hidden, bias=False)
        self.head = nn.Linear(hidden, n_classes, bias=False)
        self.act1, self.act2 = nn.ReLU(), nn.ReLU()
        with torch.no_grad():
            self.fc1.weight.normal_().mul_(first_init_scale)
            self.fc1.bias.normal_().mul_(first_init_scale)

    def forward(self, x):
        return self.head(self.act2(self.fc2(self.act1(self.fc1(x.flatten(1))))))


def he_init(model):
    """He et al. (2015) initialisation: weights N(0, 2 / fan_in), biases zero, so a signal keeps its size through ReLU
    layers. PyTorch's default (kaiming_uniform, a = sqrt(5)) shrinks it by about sqrt(3) per layer: through the CNN
    or AlexNet the output starts near zero and SGD never leaves the loss ln C (docs/running.md, "Other models")."""
    for module in model.modules():
        if isinstance(module, (nn.Conv2d, nn.Linear)):
            nn.init.kaiming_normal_(module.weight, nonlinearity="relu")
            if module.bias is not None:
                nn.init.zeros_(module.bias)
    return model


class CNN(nn.Module):
    """The paper's CNN (after Deng et al. 2021): two 3x3 convolutions of 160 channels, stride 2
    to keep the dense layers small and no pooling, then 640-320-C."""

    def __init__(self, input_shape, n_classes, channels=160):
        super().__init__()
        c, h, w = input_shape
        self.conv1 = nn.Conv2d(c, channels, 3, stride=2)
        self.conv2 = nn.Conv2d(channels, channels, 3, stride=2, bias=False)
        side = lambda n: ((n - 3) // 2 + 1 - 3) // 2 + 1
        self.fc1 = nn.Linear(channels * side(h) * side(w), 640, bias=False)
        self.fc2 = nn.Linear(640, 320, bias=False)
        self.head = nn.Linear(320, n_classes, bias=False)
        self.act1, self.act2, self.act3, self.act4 = (nn.ReLU() for _ in range(4))
        he_init(self)  # every layer, the first too: see the module docstring

    def forward(self, x):
        x = self.act2(self.conv2(self.act1(self.conv1(x))))
        x = self.act4(self.fc2(self.act3(self.fc1(x.flatten(1)))))
        return self.head(x)


# Two networks that are *not* homogeneous (biases, max-pooling, dropout, batch norm, skips): the
# paper (Sec. 6.4, App. J) shows that ReCL helps beyond its theory. The head has no bias, to grow.

class AlexNet(nn.Module):
    """AlexNet-style: five 3x3 convolutions with max-pooling, two dropout dense layers."""

    def __init__(self, input_shape, n_classes):
        super().__init__()
        c, h, w = input_shape
        conv = lambda cin, cout: [nn.Conv2d(cin, cout, 3, padding=1), nn.ReLU()]
        self.features = nn.Sequential(*conv(c, 64), nn.MaxPool2d(2), *conv(64, 192), nn.MaxPool2d(2),
                                      *conv(192, 384), *conv(384, 256), *conv(256, 256), nn.MaxPool2d(2))
        self.dense = nn.Sequential(nn.Dropout(0.5), nn.Linear(256 * (h // 8) * (w // 8), 512), nn.ReLU(),
                                   nn.Dropout(0.5), nn.Linear(512, 512), nn.ReLU())
        self.head = nn.Linear(512, n_classes, bias=False)
        he_init(self)

    def forward(self, x):
        return self.head(self.dense(self.features(x).flatten(1)))


class ResNet18(nn.Module):
    """torchvision's ResNet18 with the usual small-image stem (3x3 conv, no max-pool)."""

    def __init__(self, input_shape, n_classes):
        super().__init__()
        import torchvision
        self.features = torchvision.models.resnet18()
        self.features.conv1 = nn.Conv2d(input_shape[0], 64, 3, padding=1, bias=False)
        self.features.maxpool, self.features.fc = nn.Identity(), nn.Identity()
        self.head = nn.Linear(512, n_classes, bias=False)

    def forward(self, x):
        return self.head(self.features(x))


MODELS = ["mlp", "cnn", "alexnet", "resnet18"]
SMALLEST_SIDE = {"cnn": 7, "alexnet": 8, "resnet18": 1}


def build_model(name, input_shape, n_classes):
    if name == "mlp":
        return remember_start(MLP(int(torch.Size(input_shape).numel()), n_classes))
    if len(input_shape) != 3 or min(input_shape[1:]) < SMALLEST_SIDE[name]:
        raise ValueError(f"the {name} needs images of at least {SMALLEST_SIDE[name]} pixels a side, "
                         f"got shape {list(input_shape)}")
    return remember_start({"cnn": CNN, "alexnet": AlexNet, "resnet18": ResNet18}[name](tuple(input_shape), n_classes))


def remember_start(model):
    """Keep a copy of the weights as they are now, as the model's theta_0: reconstruction can
    fit what training added, theta - theta_0 (`--rec-target displacement`, recl.py part 1)."""
    model.start = {k: v.detach().clone() for k, v in model.named_parameters()}
    return model


def start_weights(model):
    """theta_0, on the device of the weights; None if the model never remembered it."""
    if hasattr(model, "start"):
        return {k: model.start[k].to(p.device) for k, p in model.named_parameters()}


def grow_head(model, n_classes):
    """Widen the output layer to `n_classes`, keeping the learned rows of old classes."""
    old = model.head
    if n_classes == old.out_features:
        return
    new = nn.Linear(old.in_features, n_classes, bias=False).to(old.weight.device)
    with torch.no_grad():
        new.weight[:old.out_features] = old.weight
    model.head = new
    if hasattr(model, "start"):  # the new rows start where they were initialised
        start = model.start["head.weight"]
        model.start["head.weight"] = torch.cat([start, new.weight[old.out_features:].detach().to(start.device)])


class SmoothBackwardReLUFunction(torch.autograd.Function):
    """relu(z) forward; in the backward pass sigmoid(alpha z) instead of the step.

    Reconstruction differentiates *through* gradients of the network, and the step has zero second derivative almost
    everywhere. Following Haim et al. (2022), keep the forward pass exact and smooth only the backward: sigmoid(alpha z)
    is the derivative of softplus_alpha(z) = log(1 + e^(alpha z)) / alpha, a ReLU with a rounded corner. The backward
    is plain differentiable operations, so autograd can differentiate it again (test_recl.py checks it against a slower
    detach form; docs/cost.md); setup_context and the generated vmap rule let torch.func take it as it is.
    """
    generate_vmap_rule = True

    @staticmethod
    def forward(z, alpha):
        return z.clamp_min(0)

    @staticmethod
    def setup_context(ctx, inputs, output):
        z, ctx.alpha = inputs
        ctx.save_for_backward(z)

    @staticmethod
    def backward(ctx, grad_out):
        (z,) = ctx.saved_tensors
        return grad_out * torch.sigmoid(ctx.alpha * z), None


class SmoothBackwardReLU(nn.Module):
    def __init__(self, alpha):
        super().__init__()
        self.alpha = alpha

    def forward(self, z):
        return SmoothBackwardReLUFunction.apply(z, self.alpha)


def with_smooth_relu(model, alpha):
    """A copy of `model` whose ReLUs have the smooth backward pass (for reconstruction only)."""
    copied = copy.deepcopy(model)
    for parent in copied.modules():
        for name, child in parent.named_children():
            if isinstance(child, nn.ReLU):
                setattr(parent, name, SmoothBackwardReLU(alpha))
    return copied
