"""Sibling projections of a model fused into one matmul each: q / k / v, gate / up.

A transformers layer projects its input once per sibling (``q_proj(x)``, ``k_proj(x)``,
``v_proj(x)``); at batch 1 each is a latency-bound matrix-vector product, so three launches
cost more than one over the same bytes. `fuse_projections` keeps the model's own forward
and modules: each sibling stays an `nn.Linear` (now `FusedLinear`) whose weight is a view of
one concatenated weight, and the first sibling called with an input computes all of them in
one matmul; the others take their slice when called with the same input tensor (by
identity). A sibling called with another input computes the group again, so the result is
always the plain layers' up to float rounding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["SIBLINGS", "FusedLinear", "ProjectionGroup", "fuse_projections",
           "unfuse_projections"]

# names of sibling projections that take the same input, in their weights' order
SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class ProjectionGroup:
    """The fused weight (and bias) of sibling projections and the last input's outputs.

    Parameters
    ----------
    weight : torch.Tensor
        [sum of out_features, in_features]: the siblings' weights, concatenated.
    bias : torch.Tensor or None
        [sum of out_features], or None when no sibling has a bias.
    sizes : tuple of int
        Each sibling's out_features, in order.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None,
                 sizes: tuple[int, ...]) -> None:
        self.weight, self.bias, self.sizes = weight, bias, sizes
        self.input: torch.Tensor | None = None
        self.outputs: tuple[torch.Tensor, ...] = ()
        self.left = 0

    def output(self, x: torch.Tensor, part: int) -> torch.Tensor:
        """Sibling `part`'s output for input `x` ([..., in_features]): a slice of one fused
        matmul, computed by the first sibling called with `x`. The slices are handed out
        once each; after the last, the group holds no tensor."""
        if self.input is not x or self.left == 0:
            self.outputs = F.linear(x, self.weight, self.bias).split(self.sizes, -1)
            self.input, self.left = x, len(self.sizes)
        out = self.outputs[part]
        self.left -= 1
        if self.left == 0:
            self.input, self.outputs = None, ()
        return out


class FusedLinear(nn.Linear):
    """An `nn.Linear` of a `ProjectionGroup` (attributes `group`, `part`): its weight is a
    view of the group's, its output a slice of the group's matmul."""

    group: ProjectionGroup
    part: int

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.output(x, self.part)


def _fusable(layers: list[object]) -> bool:
    if not all(type(m) is nn.Linear for m in layers):
        return False
    first = layers[0].weight
    return (len({m.in_features for m in layers}) == 1
            and len({m.bias is None for m in layers}) == 1
            and all(m.weight.dtype == first.dtype and m.weight.device == first.device
                    for m in layers))


def _fuse(layers: list[nn.Linear]) -> None:
    sizes = tuple(m.out_features for m in layers)
    weight = torch.cat([m.weight.detach() for m in layers])
    bias = None if layers[0].bias is None else torch.cat([m.bias.detach() for m in layers])
    group = ProjectionGroup(weight, bias, sizes)
    weights, biases = weight.split(sizes), bias.split(sizes) if bias is not None else None
    for i, m in enumerate(layers):
        m.weight = nn.Parameter(weights[i], requires_grad=False)
        if biases is not None:
            m.bias = nn.Parameter(biases[i], requires_grad=False)
        m.__class__ = FusedLinear
        m.group, m.part = group, i


def fuse_projections(model: nn.Module) -> int:
    """Fuse the sibling projections (`SIBLINGS`) of every module of `model` in place;
    returns how many groups were fused. Call it before the runner captures or compiles.

    A group is fused when its layers are plain `nn.Linear` of one input width, dtype and
    device, all with or all without a bias; others stay as they are. For inference: the
    fused weights take no gradients. They become views of one tensor each group (no extra
    memory once the old ones are freed), which ``save_pretrained`` refuses as shared
    memory: `unfuse_projections` first.
    """
    fused = 0
    for module in model.modules():
        for names in SIBLINGS:
            layers = [getattr(module, n, None) for n in names]
            if all(isinstance(m, nn.Module) for m in layers) and _fusable(layers):
                _fuse(layers)
                fused += 1
    return fused


def unfuse_projections(model: nn.Module) -> int:
    """Turn every `FusedLinear` of `model` back into an `nn.Linear` with weights of its own
    (copies); returns how many layers changed."""
    changed = 0
    for m in model.modules():
        if type(m) is FusedLinear:
            m.weight = nn.Parameter(m.weight.detach().clone(), requires_grad=False)
            if m.bias is not None:
                m.bias = nn.Parameter(m.bias.detach().clone(), requires_grad=False)
            del m.group, m.part
            m.__class__ = nn.Linear
            changed += 1
    return changed
