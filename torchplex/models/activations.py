"""Activation functions by the names `config.json` uses (`hidden_act`), computed as transformers' `ACT2FN`
computes them, without importing transformers.

Only parameter-free activations are here: `prelu` and `xielu` carry learned weights that a Qwen2.5-VL
checkpoint has no tensors for, so a config naming them is refused at load time instead.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


def _gelu_tanh_formula(x: torch.Tensor) -> torch.Tensor:
    # "gelu_new" / "gelu_accurate" / "gelu_python_tanh": the written-out tanh approximation. It rounds differently
    # from F.gelu(approximate="tanh"), so the names that spell it out get the spelled-out formula.
    return 0.5 * x * (1.0 + torch.tanh(_SQRT_2_OVER_PI * (x + 0.044715 * torch.pow(x, 3.0))))


def _gelu_fast(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x * (1.0 + torch.tanh(x * 0.7978845608 * (1.0 + 0.044715 * x * x)))


def _gelu_erf_formula(x: torch.Tensor) -> torch.Tensor:
    return x * 0.5 * (1.0 + torch.erf(x / math.sqrt(2.0)))


def _laplace(x: torch.Tensor, mu: float = 0.707107, sigma: float = 0.282095) -> torch.Tensor:
    return 0.5 * (1.0 + torch.erf((x - mu).div(sigma * math.sqrt(2.0))))


# Named module-level functions, not lambdas, so a model holding one still pickles.
def _gelu_10(x: torch.Tensor) -> torch.Tensor:
    return torch.clip(F.gelu(x), -10.0, 10.0)


def _gelu_pytorch_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


def _linear(x: torch.Tensor) -> torch.Tensor:
    return x


def _quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


def _relu2(x: torch.Tensor) -> torch.Tensor:
    return torch.square(F.relu(x))


def _sqrtsoftplus(x: torch.Tensor) -> torch.Tensor:
    return F.softplus(x).sqrt()


ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": F.gelu,
    "gelu_10": _gelu_10,
    "gelu_fast": _gelu_fast,
    "gelu_new": _gelu_tanh_formula,
    "gelu_python": _gelu_erf_formula,
    "gelu_pytorch_tanh": _gelu_pytorch_tanh,
    "gelu_python_tanh": _gelu_tanh_formula,
    "gelu_accurate": _gelu_tanh_formula,
    "hardswish": F.hardswish,
    "laplace": _laplace,
    "leaky_relu": F.leaky_relu,      # nn.LeakyReLU's default slope 0.01
    "linear": _linear,
    "mish": F.mish,
    "quick_gelu": _quick_gelu,
    "relu": F.relu,
    "relu2": _relu2,
    "relu6": F.relu6,
    "sigmoid": torch.sigmoid,
    "silu": F.silu,
    "sqrtsoftplus": _sqrtsoftplus,
    "swish": F.silu,
    "tanh": torch.tanh,
}


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The function `hidden_act = name` selects; KeyError naming the supported ones otherwise."""
    if name not in ACTIVATIONS:
        raise KeyError(f"unsupported hidden_act {name!r}; supported: {sorted(ACTIVATIONS)}")
    return ACTIVATIONS[name]
