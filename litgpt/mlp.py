"""The dense MLPs (GPT-NeoX's GELU MLP, LLaMA's SwiGLU, Gemma's GeGLU) and the gated product they share, with its
derivative written out so that the backward pass keeps less. Mixture-of-experts layers (`litgpt.moe`) use
`LLaMAMLP` as their experts."""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from litgpt.config import Config


class GptNeoxMLP(nn.Module):
    def __init__(self, config: Config, intermediate_size: Optional[int] = None) -> None:
        super().__init__()
        size = intermediate_size or config.intermediate_size
        self.fc = nn.Linear(config.n_embd, size, bias=config.bias)
        self.proj = nn.Linear(size, config.n_embd, bias=config.bias)
        self.approximate = config.gelu_approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x), approximate=self.approximate))


class LLaMAMLP(nn.Module):
    """SwiGLU: proj(silu(fc_1(x)) * fc_2(x))."""

    def __init__(self, config: Config, intermediate_size: Optional[int] = None) -> None:
        super().__init__()
        size = intermediate_size or config.intermediate_size
        self.fc_1 = nn.Linear(config.n_embd, size, bias=config.bias)
        self.fc_2 = nn.Linear(config.n_embd, size, bias=config.bias)
        self.proj = nn.Linear(size, config.n_embd, bias=config.bias)
        self.config = config

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.gate(self.fc_1(x), self.fc_2(x)))

    def gate(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return swiglu(self.config, gate, up)


def swiglu(config: Config, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The SwiGLU of `config`: silu(gate) * up, or gpt-oss's clamped form with swiglu_alpha and swiglu_limit."""
    if config.swiglu_limit is None:
        return GatedProduct.apply(gate, up, "silu")
    return GatedProduct.apply(gate, up, "clamped_swiglu", config.swiglu_alpha, config.swiglu_limit)


class GemmaMLP(LLaMAMLP):
    """GeGLU: the SwiGLU layout with GELU as the gate."""

    def gate(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return GatedProduct.apply(gate, up, "gelu_" + self.config.gelu_approximate)


class GatedProduct(torch.autograd.Function):
    """activation(gate) * up, keeping only `gate` and `up` for the backward pass, which recomputes the activation
    (autograd would also keep activation(gate): one more tensor of the MLP's width per block). `kind` is "silu",
    "gelu_none", "gelu_tanh" or "clamped_swiglu" (gpt-oss, with `alpha` and `limit`); the forward pass is torch's own
    functions, the derivative is written out."""

    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor, kind: str, alpha=None, limit=None) -> torch.Tensor:
        ctx.save_for_backward(gate, up)
        ctx.kind, ctx.alpha, ctx.limit = kind, alpha, limit
        if kind == "clamped_swiglu":
            g = gate.clamp(max=limit)
            return g * torch.sigmoid(g * alpha) * (up.clamp(-limit, limit) + 1)
        return _activation(gate, kind) * up

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        gate, up = ctx.saved_tensors
        if ctx.kind == "clamped_swiglu":
            return (*_clamped_swiglu_grads(grad, gate, up, ctx.alpha, ctx.limit), None, None, None)
        # grad_up as autograd computes it; the slope in the tensors' own dtype, so the backward pass allocates no
        # more than autograd's would (float32 temporaries of the MLP's width would outweigh what was saved).
        grad_up = grad * _activation(gate, ctx.kind)
        grad_gate = (grad * up).mul_(_activation_slope(gate, ctx.kind))
        return grad_gate, grad_up, None, None, None


def _clamped_swiglu_grads(grad, gate, up, alpha: float, limit: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of gpt-oss's clamped SwiGLU; a clamp passes the gradient inside its bounds, ends included (torch's
    convention)."""
    g = gate.clamp(max=limit)
    s = torch.sigmoid(g * alpha)
    u = up.clamp(-limit, limit)
    grad_up = (grad * g * s).masked_fill_((up < -limit) | (up > limit), 0)
    # d/dg of g * sigmoid(alpha * g) = s * (1 + alpha * g * (1 - s))
    slope = (1 - s).mul_(g).mul_(alpha).add_(1).mul_(s)
    grad_gate = (grad * (u + 1)).mul_(slope).masked_fill_(gate > limit, 0)
    return grad_gate, grad_up


def _activation_slope(x: torch.Tensor, kind: str) -> torch.Tensor:
    """d activation(x) / dx."""
    if kind == "silu":
        sigmoid = torch.sigmoid(x)
        return (1 - sigmoid).mul_(x).add_(1).mul_(sigmoid)  # s * (1 + x * (1 - s))
    if kind == "gelu_tanh":
        c = math.sqrt(2 / math.pi)
        tanh = torch.tanh(x.pow(3).mul_(0.044715).add_(x).mul_(c))
        # 0.5 * (1 + t) + 0.5 * x * (1 - t^2) * c * (1 + 3 * 0.044715 * x^2)
        inner = x.pow(2).mul_(3 * 0.044715 * c).add_(c).mul_(x).mul_(1 - tanh.pow(2))
        return inner.add_(tanh).add_(1).mul_(0.5)
    cdf = torch.erf(x / math.sqrt(2)).add_(1).mul_(0.5)
    return x.pow(2).mul_(-0.5).exp_().mul_(x).div_(math.sqrt(2 * math.pi)).add_(cdf)


def _activation(x: torch.Tensor, kind: str) -> torch.Tensor:
    if kind == "silu":
        return F.silu(x)
    return F.gelu(x, approximate=kind.removeprefix("gelu_"))
