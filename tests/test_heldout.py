"""The held-out MSE (`uvic.evaluation.heldout`) scores the objective the model trained on:
under flow matching the velocity of the interpolant, never the noise.

The reference is an oracle that knows the held-out image x0: from the x_t and network time
999 t it is given it recovers the noise e = (x_t - a(t) x0) / s(t) in float64 and returns
the exact velocity a'(t) x0 + s'(t) e plus a constant offset d, so its velocity MSE is d^2
exactly on any draw of t and e (a noise MSE would be mean((v + d - e)^2), far from it).
"""

from __future__ import annotations

import math

import pytest
import torch

from uvic.config import DiffusionConfig
from uvic.evaluation.heldout import heldout_loss

OFFSET = 0.3


def coefficients(name: str, t: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(a, s, a', s') of the interpolant, float64, written out here."""
    if name == "linear":
        return 1 - t, t, -torch.ones_like(t), torch.ones_like(t)
    th = math.pi / 2 * t
    return th.cos(), th.sin(), -math.pi / 2 * th.sin(), math.pi / 2 * th.cos()


class Oracle(torch.nn.Module):
    """The exact velocity of the one held-out image `x0`, plus OFFSET."""

    def __init__(self, x0: torch.Tensor, interpolant: str) -> None:
        super().__init__()
        self.x0, self.interpolant = x0.double(), interpolant
        self.dummy = torch.nn.Parameter(torch.zeros(1))  # heldout_loss asks for the device

    def forward(self, x_t: torch.Tensor, net_t: torch.Tensor, return_dict: bool = False):
        t = (net_t.double() / 999.0)[:, None, None, None]
        a, s, da, ds = coefficients(self.interpolant, t)
        noise = (x_t.double() - a * self.x0) / s
        return ((da * self.x0 + ds * noise + OFFSET).float(),)


@pytest.mark.parametrize("interpolant", ["linear", "trigonometric"])
def test_velocity_heldout_is_the_velocity_mse(interpolant: str) -> None:
    x0 = torch.rand(3, 8, 8, generator=torch.Generator().manual_seed(0)) * 2 - 1
    images = x0.expand(96, -1, -1, -1).clone()
    cfg = DiffusionConfig(objective="velocity", interpolant=interpolant, p_uncond=0.0)
    got = heldout_loss(Oracle(x0, interpolant), cfg, images, seed=5)
    assert got == pytest.approx(OFFSET ** 2, rel=1e-3)
    # a model off the velocity scores more, on the same draws for the same seed
    worse = heldout_loss(Oracle(x0 * 0.9, interpolant), cfg, images, seed=5)
    assert worse > got + 1e-3
    assert worse == heldout_loss(Oracle(x0 * 0.9, interpolant), cfg, images, seed=5)
    assert worse != heldout_loss(Oracle(x0 * 0.9, interpolant), cfg, images, seed=6)
