"""The models `--model` names, each built for the dataset's shape."""

from __future__ import annotations

from torch import nn

from ddtop.training.data import DataSpec

MLP_HIDDEN = 256


def mlp(spec: DataSpec) -> nn.Module:
    """Two hidden layers; no dropout, so its steps are exactly reproducible."""
    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(spec.channels * spec.size * spec.size, MLP_HIDDEN),
        nn.ReLU(),
        nn.Linear(MLP_HIDDEN, MLP_HIDDEN // 2),
        nn.ReLU(),
        nn.Linear(MLP_HIDDEN // 2, spec.classes),
    )


def cnn(spec: DataSpec) -> nn.Module:
    """The small CNN of PyTorch's MNIST example, sized for any input."""
    side = (spec.size - 4) // 2  # two 3x3 convolutions, then 2x2 pooling
    return nn.Sequential(
        nn.Conv2d(spec.channels, 32, 3, 1),
        nn.ReLU(),
        nn.Conv2d(32, 64, 3, 1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Dropout(0.25),
        nn.Flatten(),
        nn.Linear(64 * side * side, 128),
        nn.ReLU(),
        nn.Dropout(0.5),
        nn.Linear(128, spec.classes),
    )


def resnet18(spec: DataSpec) -> nn.Module:
    """torchvision's ResNet-18; for small images the stem is a 3x3 stride-1
    convolution without max-pooling (as usual for CIFAR), else the 7x7 stem."""
    import torchvision

    model = torchvision.models.resnet18(weights=None, num_classes=spec.classes)
    if spec.size <= 64:
        model.conv1 = nn.Conv2d(spec.channels, 64, kernel_size=3, stride=1, padding=1, bias=False)
        model.maxpool = nn.Identity()
    elif spec.channels != 3:
        model.conv1 = nn.Conv2d(spec.channels, 64, kernel_size=7, stride=2, padding=3, bias=False)
    module: nn.Module = model
    return module


BUILDERS = {"mlp": mlp, "cnn": cnn, "resnet18": resnet18}


def build_model(name: str, spec: DataSpec) -> nn.Module:
    return BUILDERS[name](spec)
