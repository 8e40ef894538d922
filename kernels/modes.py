"""The attention designs: one record each, read by every part of uvic that lists them.

The kernels dispatch on the names; the model's presets and letters, the processors, the
analysis, the experiments and the benchmark rows are made from the records. No torch
here, so the command line can offer the designs before torch loads.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Design:
    """An attention design: its mode name, how uvic names and checks it, what it computes."""

    name: str  # the kernels' `mode`
    title: str  # in prose and figures
    letter: str  # one letter per block in short accounts of a pattern ("SCCS")
    preset: str  # the U-ViT with this design in every block but the first and the last
    weights: str  # A as a function of the scores S = scale * q k^T (the float64 reference)
    reference: str  # its float64 oracle in `uvic_kernels.reference`
    normalised: bool = True  # sum_j |A_ij| = 1 in every row
    sdpa: bool = False  # PyTorch's scaled_dot_product_attention computes it
    kernel: bool = True  # a mode of the kernel family; else a module that calls the kernel


DESIGNS = (
    Design("cog", "Cog attention", "C", "uvic", "sign(S) * softmax(|S|)",
           "cog_attention_reference"),
    Design("softmax", "softmax attention", "S", "uvit", "softmax(S)",
           "softmax_attention_reference", sdpa=True),
    Design("expressive", "expressive attention", "E", "uvie",
           "E / rowsum(E), E = S^2 / (1 + S^2)", "expressive_attention_reference"),
    Design("sigmoid", "sigmoid attention", "G", "uvis", "sigmoid(S + b), b = -log N by default",
           "sigmoid_attention_reference", normalised=False),
    Design("differential", "differential attention", "D", "uvid",
           "softmax(S1) - lambda softmax(S2), h/2 heads of value width 2d",
           "differential_attention_reference", normalised=False, sdpa=True, kernel=False),
    Design("differential_v2", "differential attention V2", "V", "uvid2",
           "softmax(S1) - sigmoid(x . w) softmax(S2), a weight per query token and head, "
           "h heads sharing K and V", "differential_v2_attention_reference", normalised=False,
           sdpa=True, kernel=False),
)
DESIGN = {d.name: d for d in DESIGNS}
MODES = tuple(d.name for d in DESIGNS if d.kernel)  # the kernels' modes
# The designs each backend runs (SDPA: those made of PyTorch's own softmax attention).
_ALL = tuple(DESIGN)
BACKEND_MODES = {"triton": _ALL, "torch": _ALL, "sdpa": tuple(d.name for d in DESIGNS if d.sdpa)}
BACKENDS = tuple(BACKEND_MODES)
GATED = "+gate"  # "cog+gate": a design with the output gate, in the toy experiments' names
