"""Fused Cog / softmax / expressive / sigmoid attention kernels against float64 autograd
references.

Without CUDA the Triton kernels run in Triton's CPU interpreter (tests/conftest.py
sets TRITON_INTERPRET=1 before anything imports triton); with CUDA the same tests
run the compiled kernels, plus bf16 and a larger grid.  The interpreter costs
~10 ms per program, so CPU shapes stay small.
"""

from __future__ import annotations

import json
import math
import os

import pytest
import torch

if not torch.cuda.is_available():  # no-op when conftest.py already set it
    os.environ.setdefault("TRITON_INTERPRET", "1")

import uvic_kernels
from uvic_kernels import (
    attention,
    cog_attention_eq3,
    cog_attention_reference,
    expressive_attention_reference,
    fused_attention,
    reference,
    sigmoid_attention_reference,
    softmax_attention_reference,
)
from uvic_kernels.modes import DESIGNS

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
TOL = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 2e-2}
# every design's float64 oracle, from its record (sigmoid: bias -log(Nkv) unless given)
REFERENCES = {d.name: getattr(reference, d.reference) for d in DESIGNS if d.kernel}
MODES = list(REFERENCES)
# bf16 tl.dot is wrong in the interpreter: bf16 kernels are checked on a GPU only
KERNEL_DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if CUDA else [])


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    """||x - ref|| / ||ref|| (Frobenius); absolute when the reference is exactly 0."""
    x, ref = x.double(), ref.double()
    denom = ref.norm().item()
    return (x - ref).norm().item() / (denom if denom > 0 else 1.0)


def randn(*shape: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).to(device=DEVICE, dtype=dtype)


def run(q, k, v, do, mode, scale=None, backend="triton", bias=None):
    """Output and (dq, dk, dv) of uvic_kernels.attention, and d bias after them for a
    tensor ``bias`` (sigmoid)."""
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    leaves = (q, k, v)
    if isinstance(bias, torch.Tensor):
        bias = bias.detach().requires_grad_()
        leaves += (bias,)
    kwargs = {} if bias is None else {"bias": bias}
    out = attention(q, k, v, mode, scale, backend=backend, **kwargs)
    return out, torch.autograd.grad(out, leaves, do)


def run_reference(q, k, v, do, mode, scale=None, bias=None):
    """Float64 output and gradients of the reference formula (autograd)."""
    q, k, v = (x.detach().double().requires_grad_() for x in (q, k, v))
    leaves = (q, k, v)
    if isinstance(bias, torch.Tensor):
        bias = bias.detach().double().requires_grad_()
        leaves += (bias,)
    args = () if bias is None else (bias,)
    out = REFERENCES[mode](q, k, v, scale, *args)
    return out, torch.autograd.grad(out, leaves, do.double())


def assert_close_to_reference(q, k, v, do, mode, tol, scale=None, backend="triton", bias=None):
    out, grads = run(q, k, v, do, mode, scale, backend, bias)
    ref_out, ref_grads = run_reference(q, k, v, do, mode, scale, bias)
    assert out.dtype == q.dtype and out.shape == q.shape
    errors = [rel_err(out, ref_out)] + [rel_err(g, r) for g, r in zip(grads, ref_grads)]
    assert max(errors) < tol, f"rel. errors (o, dq, dk, dv[, dbias]) = {errors}"
    return errors


# ---------------------------------------------------------------------------------------
# Accuracy against float64 autograd
# ---------------------------------------------------------------------------------------

# (B, H, Nq, Nkv, D, scale): N = 1, N off every block size, D not a power of two, D < 16
SHAPES = [
    (1, 1, 1, 1, 32, None),
    (1, 2, 17, 17, 64, None),
    (2, 1, 77, 77, 72, None),
    (1, 1, 257, 257, 128, None),
    (1, 2, 64, 64, 32, 0.5),
    (1, 1, 40, 40, 8, None),
    (1, 2, 33, 70, 64, None),  # cross-attention lengths
    (1, 1, 20, 20, 24, -0.3),  # a negative scale flips every sign
    (1, 1, 20, 20, 24, 0.0),  # every score an exact zero: Cog weights all 0
]
FP16_SHAPES = [(1, 2, 77, 77, 64, None), (1, 1, 257, 257, 72, None), (2, 1, 17, 17, 128, None)]
CASES = [(torch.float32, s) for s in SHAPES] + [
    (dt, s) for dt in KERNEL_DTYPES if dt != torch.float32 for s in FP16_SHAPES
]


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    ("dtype", "shape"), CASES, ids=[f"{str(dt)[6:]}-{s[:5]}" for dt, s in CASES]
)
def test_kernel_matches_reference(mode, dtype, shape):
    b, h, nq, nkv, d, scale = shape
    q, k, v = (randn(b, h, n, d, dtype=dtype, seed=i) for i, n in enumerate((nq, nkv, nkv)))
    do = randn(b, h, nq, d, dtype=dtype, seed=3)
    assert_close_to_reference(q, k, v, do, mode, TOL[dtype], scale)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_torch_backend_matches_reference(mode, dtype):
    q, k, v = (randn(2, 2, 77, 72, dtype=dtype, seed=i) for i in range(3))
    do = randn(2, 2, 77, 72, dtype=dtype, seed=3)
    assert_close_to_reference(q, k, v, do, mode, TOL[dtype], backend="torch")


@pytest.mark.parametrize("mode", MODES)
def test_torch_backend_equals_kernel(mode):
    q, k, v, do = (randn(1, 2, 77, 72, seed=i) for i in range(4))
    out_t, grads_t = run(q, k, v, do, mode, backend="triton")
    out_p, grads_p = run(q, k, v, do, mode, backend="torch")
    assert rel_err(out_t, out_p) < 1e-5
    for g_t, g_p in zip(grads_t, grads_p):
        assert rel_err(g_t, g_p) < 1e-5


@pytest.mark.parametrize("mode", MODES)
def test_row_statistic(mode):
    """The forward's row statistic: log-sum-exp of S (softmax) or |S| (cog), the row sum
    N of S^2 / (1 + S^2) (expressive), or the bias (sigmoid, default -log Nkv), which the
    backward recomputes weights from."""
    from uvic_kernels import launch

    q, k, v = (randn(1, 2, 77, 32, seed=i) for i in range(3))
    _, stat = launch.forward(q, k, v, mode, 0.25)
    s = 0.25 * q.double() @ k.double().transpose(-2, -1)
    if mode == "expressive":
        ref = (s * s / (1 + s * s)).sum(dim=-1)
    elif mode == "sigmoid":
        ref = torch.full((1, 2, 77), -math.log(77), dtype=torch.float64)
    else:
        ref = torch.logsumexp(s.abs() if mode == "cog" else s, dim=-1)
    assert stat.dtype == torch.float32 and stat.shape == (1, 2, 77)
    assert rel_err(stat, ref) < 1e-6


def test_expressive_all_zero_row():
    """A row whose scores are all exactly 0 has N = 0: weights, output and gradients 0."""
    q, k, v, do = (randn(1, 2, 37, 32, seed=i) for i in range(4))
    q[0, 0, 3] = 0.0  # one zero query row
    q[0, 1] = 0.0  # a head whose rows are all zero
    for backend in ("triton", "torch"):
        out, (dq, dk, dv) = run(q, k, v, do, "expressive", backend=backend)
        assert torch.isfinite(out).all() and (out[0, 0, 3] == 0).all() and (out[0, 1] == 0).all()
        assert (dq[0, 0, 3] == 0).all() and (dq[0, 1] == 0).all()
        assert (dk[0, 1] == 0).all() and (dv[0, 1] == 0).all()
        assert_close_to_reference(q, k, v, do, "expressive", TOL[torch.float32], backend=backend)
    ref = expressive_attention_reference(q.double(), k.double(), v.double())
    assert (ref[0, 1] == 0).all()


# ---------------------------------------------------------------------------------------
# Sigmoid attention: the bias, saturated weights
# ---------------------------------------------------------------------------------------

# (B, H, Nq, Nkv, D): N off every block size, cross-attention lengths, D not a power of two
SIGMOID_BIAS_SHAPES = [(2, 3, 45, 45, 40), (1, 2, 33, 70, 72), (1, 1, 1, 1, 16)]


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("shape", SIGMOID_BIAS_SHAPES, ids=str)
def test_sigmoid_learnable_bias(shape, backend):
    """A per-head bias tensor (H,): output and the gradients of q, k, v and the bias against
    float64; a single bias tensor (shape () and (1,)) gets the sum over heads."""
    b, h, nq, nkv, d = shape
    q, k, v = (randn(b, h, n, d, seed=i) for i, n in enumerate((nq, nkv, nkv)))
    do = randn(b, h, nq, d, seed=3)
    per_head = randn(h, seed=4) - 2.0
    errors = assert_close_to_reference(q, k, v, do, "sigmoid", TOL[torch.float32],
                                       backend=backend, bias=per_head)
    assert len(errors) == 5  # o, dq, dk, dv, dbias
    for single in (torch.tensor(-1.5, device=DEVICE), torch.tensor([0.7], device=DEVICE)):
        assert_close_to_reference(q, k, v, do, "sigmoid", TOL[torch.float32], 0.3,
                                  backend=backend, bias=single)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_sigmoid_bias_forms(backend):
    """No bias is -log(Nkv); a number, a 0-d tensor and a per-head tensor of the same value
    give the same bits; a per-head bias acts on its own head only."""
    q = randn(2, 2, 21, 16, seed=0)
    k, v = randn(2, 2, 37, 16, seed=1), randn(2, 2, 37, 16, seed=2)
    default = attention(q, k, v, "sigmoid", backend=backend)
    assert torch.equal(default, attention(q, k, v, "sigmoid", bias=-math.log(37), backend=backend))
    for value in (torch.tensor(-math.log(37)), torch.full((2,), -math.log(37))):
        assert torch.equal(default, attention(q, k, v, "sigmoid", bias=value.to(DEVICE),
                                              backend=backend))
    bias = torch.tensor([-math.log(37), 2.0], device=DEVICE)
    out = attention(q, k, v, "sigmoid", bias=bias, backend=backend)
    assert torch.equal(out[:, 0], default[:, 0]) and not torch.equal(out[:, 1], default[:, 1])
    ref = sigmoid_attention_reference(q.double(), k.double(), v.double(), None, bias.double())
    assert rel_err(out, ref) < 1e-6
    # fp16 inputs with an fp32 bias (the model's parameter under autocast): the bias's dtype
    out16 = attention(q.half(), k.half(), v.half(), "sigmoid", bias=bias, backend=backend)
    assert out16.dtype == torch.float16 and rel_err(out16, ref) < TOL[torch.float16]


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_sigmoid_bias_gradient_alone(backend):
    """Only the bias needs a gradient (q, k, v frozen): the dQ kernel still runs, for the
    row sums of dS, and nothing else is returned."""
    q, k, v, do = (randn(1, 2, 70, 32, seed=i) for i in range(4))
    bias = (randn(2, seed=5) - 3.0).requires_grad_()
    out = attention(q, k, v, "sigmoid", bias=bias, backend=backend)
    (dbias,) = torch.autograd.grad(out, (bias,), do)
    ref = run_reference(q, k, v, do, "sigmoid", bias=bias)[1][3]
    assert dbias.shape == (2,) and rel_err(dbias, ref) < 1e-5


def _saturated_inputs(n: int = 70, d: int = 32) -> tuple[torch.Tensor, ...]:
    """Scores of 15..60 with O(1) spread: every weight rounds to 1 in fp32, so A (1 - A)
    formed as a product of fp32 weights is 0 while the true slope is exp(-|S + b|)."""
    q, k, v, do = (randn(1, 2, n, d, seed=i) for i in range(4))
    q[..., 0] = 6.0
    k[..., 0] = (5.0 + randn(1, 2, n, seed=5).abs()) * math.sqrt(d)  # scale * q.k = 30 +- O(6)
    return q, k, v, do


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("sign", [1.0, -1.0], ids=["saturated-at-1", "saturated-at-0"])
def test_sigmoid_saturated_scores(backend, sign):
    """Adversarial logits: weights all ~1 (or all ~0 with the sign flipped).  The output
    and every gradient stay accurate to what fp32 scores allow (a score of ~35 is known to
    ~1e-5 absolute, which is the relative error of its slope exp(-|S + b|)), where fp32
    autograd of sigmoid(S + b) @ v loses the tiny slopes entirely (dQ and dK wrong)."""
    q, k, v, do = _saturated_inputs()
    q = sign * q
    bias = torch.tensor([-math.log(70), 3.0], device=DEVICE)
    errors = assert_close_to_reference(q, k, v, do, "sigmoid", 1e-4, backend=backend, bias=bias)
    assert all(math.isfinite(e) for e in errors)
    if sign > 0:
        q32, k32 = (x.detach().requires_grad_() for x in (q, k))
        o32 = sigmoid_attention_reference(q32, k32, v, None, bias)
        dq32 = torch.autograd.grad(o32, (q32,), do)[0]
        ref_dq = run_reference(q, k, v, do, "sigmoid", bias=bias)[1][0]
        assert rel_err(dq32, ref_dq) > 0.1  # the naive fp32 form fails here


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_sigmoid_extreme_logits_stay_finite(backend):
    """Scores of +-1e4 and biases of +-1e3: weights exactly 0 or 1, never NaN or inf."""
    q, k, v, do = _huge_score_inputs()
    for bias in (torch.tensor([1e3, -1e3], device=DEVICE), None):
        out, grads = run(q, k, v, do, "sigmoid", backend=backend, bias=bias)
        assert all(torch.isfinite(x).all() for x in (out, *grads))
        ref_out, _ = run_reference(q, k, v, do, "sigmoid", bias=bias)
        assert rel_err(out, ref_out) < 1e-5


@pytest.mark.slow
def test_sigmoid_bitwise_deterministic_bias_gradient():
    """The bias gradient is a sum in a fixed order: two runs give the same bits."""
    q, k, v, do = (randn(2, 2, 257, 64, seed=i) for i in range(4))
    bias = randn(2, seed=5) - 5.0
    first, second = (run(q, k, v, do, "sigmoid", bias=bias) for _ in range(2))
    for a, b in zip((first[0], *first[1]), (second[0], *second[1])):
        assert torch.equal(a, b)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_sigmoid_bias_under_torch_compile(backend):
    """A learnable bias through the custom ops: torch.compile captures it in one graph and
    gives eager's gradients, the bias's included."""
    q, k, v, do = (randn(1, 2, 20, 16, seed=i) for i in range(4))
    bias = (randn(2, seed=5) - 2.0).requires_grad_()

    def loss(q, k, v, bias):
        return (attention(q, k, v, "sigmoid", backend=backend, bias=bias) * do).sum()

    compiled = torch.compile(loss, backend="aot_eager", fullgraph=True)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    grads = torch.autograd.grad(compiled(q, k, v, bias), (q, k, v, bias))
    eager = torch.autograd.grad(loss(q, k, v, bias), (q, k, v, bias))
    for g, e in zip(grads, eager):  # eager PyTorch keeps the weights: same maths
        assert torch.equal(g, e) if backend != "torch" else rel_err(g, e) < 1e-6


# ---------------------------------------------------------------------------------------
# Sequence remainders: full blocks, TAIL-wide steps and TAIL-row programs
# ---------------------------------------------------------------------------------------

# N around every block size the kernels use (16, 32, 64, 128) and U-ViT's 257 / 334
REMAINDER_NS = [1, 2, 15, 16, 17, 63, 64, 65, 127, 128, 129, 257, 334]
REMAINDER_DS = [32, 64, 72, 128]


# Expressive attention with one or two keys is checked in test_expressive_one_or_two_keys
# instead: with one key its weight is E / E = 1 and the exact dQ, dK are 0, so a relative
# error against float64 only measures rounding noise.
REMAINDER_CASES = [(n, m) for n in REMAINDER_NS for m in MODES if m != "expressive" or n > 2]


@pytest.mark.slow
@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=lambda dt: str(dt)[6:])
@pytest.mark.parametrize("d", REMAINDER_DS)
@pytest.mark.parametrize(("n", "mode"), REMAINDER_CASES)
def test_sequence_remainders(n, mode, d, dtype):
    """Output and all three gradients against float64 for every remainder shape."""
    q, k, v, do = (randn(1, 1, n, d, dtype=dtype, seed=i) for i in range(4))
    assert_close_to_reference(q, k, v, do, mode, TOL[dtype])


@pytest.mark.parametrize("d", REMAINDER_DS)
def test_expressive_one_or_two_keys(d):
    """One key: weight 1, so O = v and dQ = dK = 0 up to fp32 rounding (amplified by 1 / N,
    N = E = s^2 / (1 + s^2) small for a near-orthogonal pair); two keys: fp32 accuracy."""
    q, k, v, do = (randn(1, 2, 1, d, seed=i) for i in range(4))
    out, (dq, dk, dv) = run(q, k, v, do, "expressive")
    assert rel_err(out, v) < 1e-6 and rel_err(dv, do) < 1e-6
    s = (q * k).sum(-1, keepdim=True) * d**-0.5
    noise = 1e-6 * do.norm() * v.norm() / (s * s / (1 + s * s)).min()  # rounding / N
    assert dq.norm() < noise * k.norm() and dk.norm() < noise * q.norm()
    q, k, v, do = (randn(1, 2, 2, d, seed=i) for i in range(4))
    assert_close_to_reference(q, k, v, do, "expressive", TOL[torch.float32])


def _force_tiles(monkeypatch, fwd, dkdv, dq):
    """Run the kernels with the given (BLOCK_M, BLOCK_N) tiles instead of their own."""
    import triton

    from uvic_kernels import triton_attention as ta

    for kernel, (bm, bn) in ((ta._attn_fwd, fwd), (ta._attn_bwd_dkdv, dkdv), (ta._attn_bwd_dq, dq)):
        config = triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=4, num_stages=2)
        monkeypatch.setattr(kernel, "configs", [config])


OTHER_TILES = {
    "tall-wide": ((128, 32), (32, 128), (128, 32)),
    "tail-sized": ((16, 16), (16, 16), (16, 16)),  # slow in the interpreter: short N only
    "mixed": ((32, 64), (64, 32), (16, 64)),
}
# In the interpreter, short N only for the smallest tiles and no N = 334 for the mixed ones
# (170 already ends every tile of them in a partial one); compiled on a GPU, all of them.
OTHER_TILE_CASES = [
    (name, n) for name in OTHER_TILES for n in (45, 129, 170, 334)
    if CUDA or ((name != "tail-sized" or n < 170) and (name != "mixed" or n < 334))
]


@pytest.mark.slow
@pytest.mark.parametrize(("tiles", "n"), OTHER_TILE_CASES,
                         ids=[f"{name}-{n}" for name, n in OTHER_TILE_CASES])
@pytest.mark.parametrize("mode", MODES)
def test_other_tiles(monkeypatch, tiles, n, mode):
    """Blocks larger than, equal to and smaller than TAIL-multiples of N: every split of
    a sequence into full blocks, TAIL-wide steps, TAIL-row programs and masked
    full-size remainder programs is exact (e.g. N = 170 with 128-row blocks: a 42-row
    remainder runs as one masked program; N = 129: one 16-row program)."""
    _force_tiles(monkeypatch, *OTHER_TILES[tiles])
    q, k, v, do = (randn(1, 2, n, 32, seed=i) for i in range(4))
    k2, v2 = randn(1, 2, n + 30, 32, seed=5), randn(1, 2, n + 30, 32, seed=6)
    assert_close_to_reference(q, k, v, do, mode, TOL[torch.float32])
    assert_close_to_reference(q, k2, v2, do, mode, TOL[torch.float32])  # cross-attention


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_bitwise_deterministic(mode):  # sigmoid's bias gradient: see the test below it
    """Two runs give identical bits (no atomics): exact resume of training depends on it."""
    q, k, v, do = (randn(2, 2, 257, 64, seed=i) for i in range(4))
    out_a, grads_a = run(q, k, v, do, mode)
    out_b, grads_b = run(q, k, v, do, mode)
    for a, b in zip((out_a, *grads_a), (out_b, *grads_b)):
        assert torch.equal(a, b)


def test_computed_fraction_of_scores():
    """At U-ViT's sequence lengths at least 80% (N = 257) / 85% (N = 334) of the score
    elements every kernel computes are real, for every tile the kernels may use."""
    from uvic_kernels import tiles

    kinds = {
        "fwd": tiles.GPU_FWD_TILES, "dkdv": tiles.GPU_BWD_DKDV_TILES, "dq": tiles.GPU_BWD_DQ_TILES
    }
    for n, floor in ((257, 0.80), (334, 0.85)):
        for kind, tile_list in kinds.items():
            for bm, bn, _, _ in tile_list:
                assert tiles.computed_fraction(n, n, bm, bn, kind) >= floor, (n, kind, bm, bn)
    # whole blocks for the remainder would waste nearly half at N = 257
    assert tiles.computed_fraction(257, 257, 128, 64, "fwd") == pytest.approx(257**2 / 272**2)
    # remainders: 16-row programs, or one masked full-size program when those cost more
    assert tiles.num_programs(257, 128) == 2 + 1 and tiles.num_programs(280, 128) == 2 + 2
    assert tiles.num_programs(334, 128) == 2 + 1 and tiles.num_programs(334, 64) == 5 + 1
    assert tiles.num_programs(15, 64) == 1 and tiles.num_programs(256, 64) == 4


# ---------------------------------------------------------------------------------------
# Edge cases
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("mode", MODES)
def test_exact_zero_scores(mode, backend):
    """Zero query rows and zero keys give S == 0 exactly: weight 0 (cog) but counted in
    the denominator; gradients match autograd of sign(S) * softmax(|S|)."""
    q, k, v, do = (randn(1, 2, 37, 32, seed=i) for i in range(4))
    q[0, 0, 3] = 0.0  # one zero query row
    k[0, 0, 5] = 0.0  # one zero key (a zero score column)
    k[0, 0, 30] = 0.0  # ... also in the masked tail block of the kernel
    q[0, 1] = 0.0  # a head whose scores are all exactly 0
    errors = assert_close_to_reference(q, k, v, do, mode, TOL[torch.float32], backend=backend)
    assert all(math.isfinite(e) for e in errors)


def _huge_score_inputs(n: int = 70, d: int = 32) -> tuple[torch.Tensor, ...]:
    """Scores of about +-1e4 with O(1) spread (and random signs), so the weights and
    gradients are not degenerate: exp(|s|) overflows without the max subtraction."""
    q, k, v, do = (randn(1, 2, n, d, seed=i) for i in range(4))
    sign = torch.where(randn(1, 2, n, seed=5) > 0, 1.0, -1.0)
    q[..., 0] = 100.0
    k[..., 0] = 100.0 * math.sqrt(d) * sign  # scale * q.k = +-1e4 + O(1)
    return q, k, v, do


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("mode", MODES)
def test_huge_scores(mode, backend):
    q, k, v, do = _huge_score_inputs()
    s = (q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5
    assert s.abs().max() > 9e3
    out, grads = run(q, k, v, do, mode, backend=backend)
    ref_out, ref_grads = run_reference(q, k, v, do, mode)
    assert all(torch.isfinite(x).all() for x in (out, *grads))
    # A fp32 score of size 1e4 is only known to ~1e-3 absolute (ulp 1e-3), which moves
    # every weight by ~1e-3 relative: compare with PyTorch's own fp32 autograd error.
    q32, k32, v32 = (x.detach().requires_grad_() for x in (q, k, v))
    o32 = REFERENCES[mode](q32, k32, v32)
    g32 = torch.autograd.grad(o32, (q32, k32, v32), do)
    for x, x32, ref in zip((out, *grads), (o32, *g32), (ref_out, *ref_grads)):
        assert rel_err(x, ref) <= max(2 * rel_err(x32, ref), 1e-5)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_single_sign_rows(mode, sign):
    """All scores of every row positive (cog = softmax) or all negative (cog = -softmax(-S))."""
    q = randn(1, 2, 77, 32, seed=0).abs()
    k = sign * randn(1, 2, 77, 32, seed=1).abs()
    v, do = randn(1, 2, 77, 32, seed=2), randn(1, 2, 77, 32, seed=3)
    assert_close_to_reference(q, k, v, do, mode, TOL[torch.float32])
    if mode == "cog":
        out = attention(q, k, v, "cog", backend="triton")
        same = sign * attention(q, sign * k, v, "softmax", backend="triton")
        assert rel_err(out, same) < 1e-5


@pytest.mark.filterwarnings("ignore:.*(NaN|invalid value):RuntimeWarning")  # numpy, interpreter
@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("where", ["q", "k", "v"])
@pytest.mark.parametrize("row", [5, 70], ids=["full-block", "tail-block"])
def test_nan_propagates(where, row, mode, backend):
    """A NaN in q, k or v reaches the output (max / where must not swallow it)."""
    q, k, v = (randn(1, 1, 77, 32, seed=i) for i in range(3))
    {"q": q, "k": k, "v": v}[where][0, 0, row, 7] = float("nan")
    out = attention(q, k, v, mode, backend=backend)[0, 0]
    nan = torch.isnan(out)
    if where == "q":  # one query row
        assert nan[row].all() and not nan[torch.arange(77) != row].any()
    elif where == "k":  # one key: every score row
        assert nan.all()
    else:  # one value entry: one output column
        assert nan[:, 7].all() and nan.sum() == 77


# ---------------------------------------------------------------------------------------
# The two reference forms of Cog attention
# ---------------------------------------------------------------------------------------


def test_references_agree_without_zero_scores():
    q, k, v = (randn(2, 3, 50, 16, dtype=torch.float64, seed=i) for i in range(3))
    a, b = cog_attention_reference(q, k, v), cog_attention_eq3(q, k, v)
    assert rel_err(a, b) < 1e-13
    # with all scores positive, Cog attention is softmax attention
    q, k = q.abs(), k.abs()
    assert rel_err(cog_attention_reference(q, k, v), softmax_attention_reference(q, k, v)) < 1e-13


def test_references_differ_at_exact_zero_score():
    """eq. 3 drops SignExp(0) = 0 from the denominator; sign * softmax(|S|) counts exp(-max)."""
    q, k, v = (randn(1, 1, 6, 4, dtype=torch.float64, seed=i) for i in range(3))
    k[0, 0, 2] = 0.0  # column 2 of every row is an exact zero score
    a, b = cog_attention_reference(q, k, v), cog_attention_eq3(q, k, v)
    assert not torch.allclose(a, b, rtol=1e-6, atol=0)
    # eq. 3 renormalises over the 5 non-zero keys: dropping the key changes nothing there
    keep = [0, 1, 3, 4, 5]
    assert rel_err(b, cog_attention_eq3(q, k[..., keep, :], v[..., keep, :])) < 1e-13
    # an all-zero score row: weight 0 everywhere (output 0) vs 0 / 0 in eq. 3
    q[0, 0, 0] = 0.0
    assert (cog_attention_reference(q, k, v)[0, 0, 0] == 0).all()
    assert torch.isnan(cog_attention_eq3(q, k, v)[0, 0, 0]).all()


# ---------------------------------------------------------------------------------------
# Layouts, grid size, gradients subsets, autocast
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_non_contiguous_inputs(mode):
    """q, k, v as views of a (B, N, 3, H, D) qkv tensor, dO transposed in memory."""
    b, n, h, d = 2, 45, 2, 40
    qkv = randn(b, n, 3, h, d, seed=0).permute(2, 0, 3, 1, 4)
    q, k, v = qkv[0], qkv[1], qkv[2]
    do = randn(b, h, d, n, seed=1).transpose(-2, -1)
    assert not any(x.is_contiguous() for x in (q, k, v, do))
    assert_close_to_reference(q, k, v, do, mode, TOL[torch.float32])


@pytest.mark.slow
def test_many_heads_small_sequences():
    """A large B*H (the grid is 1-D, so it is not bounded by CUDA's 65535 on axis 1)."""
    b, h = (1024, 80) if CUDA else (8, 8)  # the interpreter runs every program: 64 heads
    q, k, v, do = (randn(b, h, 4, 32, seed=i) for i in range(4))
    out, grads = run(q, k, v, do, "cog")
    ref_out, ref_grads = run(q, k, v, do, "cog", backend="torch")
    assert rel_err(out, ref_out) < 1e-5
    for g, r in zip(grads, ref_grads):
        assert rel_err(g, r) < 1e-5
    # every head really was computed: spot-check the last one against float64
    last = run_reference(q[-1:, -1:], k[-1:, -1:], v[-1:, -1:], do[-1:, -1:], "cog")[0]
    assert rel_err(out[-1:, -1:], last) < 1e-5


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_gradient_subsets_and_no_grad(backend):
    q, k, v, do = (randn(1, 2, 20, 16, seed=i) for i in range(4))
    v_leaf = v.clone().requires_grad_()
    out = attention(q, k, v_leaf, "cog", backend=backend)
    (dv,) = torch.autograd.grad(out, (v_leaf,), do)
    _, ref_grads = run_reference(q, k, v, do, "cog")
    assert rel_err(dv, ref_grads[2]) < 1e-5
    with torch.no_grad():
        assert torch.equal(attention(q, k, v, "cog", backend=backend), out.detach())


@pytest.mark.parametrize("mode", MODES)
def test_dq_only_and_dkdv_only(mode):
    """dQ alone (its kernel computes Delta) and dK/dV alone (Delta from its own kernel)."""
    q, k, v, do = (randn(1, 2, 70, 32, seed=i) for i in range(4))
    _, ref_grads = run_reference(q, k, v, do, mode)
    q_leaf = q.clone().requires_grad_()
    (dq,) = torch.autograd.grad(attention(q_leaf, k, v, mode, backend="triton"), (q_leaf,), do)
    k_leaf = k.clone().requires_grad_()
    (dk,) = torch.autograd.grad(attention(q, k_leaf, v, mode, backend="triton"), (k_leaf,), do)
    assert rel_err(dq, ref_grads[0]) < 1e-5 and rel_err(dk, ref_grads[1]) < 1e-5


def test_sdpa_backend():
    """backend='sdpa' is PyTorch's softmax attention (a baseline); Cog refuses it."""
    q, k, v, do = (randn(1, 2, 33, 24, seed=i) for i in range(4))
    assert_close_to_reference(q, k, v, do, "softmax", TOL[torch.float32], 0.3, backend="sdpa")
    with pytest.raises(ValueError, match="softmax attention only"):
        attention(q, k, v, "cog", backend="sdpa")


def test_empty_batch():
    q = torch.empty(0, 2, 10, 16, device=DEVICE)
    assert attention(q, q, q, backend="triton").shape == (0, 2, 10, 16)


def test_torch_backend_under_autocast():
    """Autocast does not leak into the fallback: fp32 stays fp32-accurate, bf16 stays bf16."""
    q, k, v = (randn(1, 2, 30, 24, seed=i) for i in range(3))
    with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
        out32 = attention(q, k, v, "cog", backend="torch")
        out16 = attention(*(x.bfloat16() for x in (q, k, v)), "cog", backend="torch")
    ref = cog_attention_reference(q.double(), k.double(), v.double())
    assert out32.dtype == torch.float32 and rel_err(out32, ref) < 1e-5
    ref16 = cog_attention_reference(*(x.bfloat16().double() for x in (q, k, v)))
    assert out16.dtype == torch.bfloat16 and rel_err(out16, ref16) < TOL[torch.bfloat16]


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_torch_compile_fullgraph(backend):
    """The kernels are custom ops: torch.compile captures attention without graph breaks."""
    q, k, v, do = (randn(1, 2, 20, 16, seed=i) for i in range(4))

    def loss(q, k, v):
        return (attention(q, k, v, "cog", backend=backend) * do).sum()

    compiled = torch.compile(loss, backend="aot_eager", fullgraph=True)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    grads = torch.autograd.grad(compiled(q, k, v), (q, k, v))
    eager_grads = torch.autograd.grad(loss(q, k, v), (q, k, v))
    for g, e in zip(grads, eager_grads):  # eager PyTorch keeps the weights: same maths
        assert torch.equal(g, e) if backend != "torch" else rel_err(g, e) < 1e-6


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["torch", None])
def test_torch_compile_inductor(backend):
    """torch.compile with its default backend (inductor; C++ on a CPU) captures a function
    calling attention in one graph, forward and backward, and matches eager.  ``None`` is
    the default backend: Triton on CUDA; on a CPU the PyTorch path, or the interpreter
    when TRITON_INTERPRET=1 (as in these tests)."""
    torch._dynamo.reset()
    q, k, v, do = (randn(2, 2, 20, 16, seed=i) for i in range(4))
    w = randn(16, 16, seed=5)

    def loss(q, k, v):
        out = attention(torch.tanh(q @ w), k, v, "cog", backend=backend)
        return (out * do).sum()

    explanation = torch._dynamo.explain(loss)(q, k, v)
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1
    compiled = torch.compile(loss, fullgraph=True)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    value = compiled(q, k, v)
    grads = torch.autograd.grad(value, (q, k, v))
    eager = loss(q, k, v)
    eager_grads = torch.autograd.grad(eager, (q, k, v))
    assert rel_err(value, eager) < 1e-5
    for g, e in zip(grads, eager_grads):
        assert rel_err(g, e) < 1e-5


# ---------------------------------------------------------------------------------------
# Host path: launches, custom ops
# ---------------------------------------------------------------------------------------


class _Calls:
    """Counts the calls of a function it wraps (monkeypatched over the original)."""

    def __init__(self, fn):
        self.fn, self.n = fn, 0

    def __call__(self, *args, **kwargs):
        self.n += 1
        return self.fn(*args, **kwargs)


def test_launch_follows_layout_and_alignment():
    """Other strides and a pointer off Triton's 16-byte alignment give the same output."""
    from uvic_kernels import launch

    q, k, v = (randn(1, 2, 40, 32, seed=i) for i in range(3))
    out = launch.forward(q, k, v, "cog", 0.2)[0]
    shifted = torch.empty(q.numel() + 1, device=DEVICE)[1:].view(q.shape)  # 4 bytes off
    shifted.copy_(q)
    assert shifted.data_ptr() % 16 != 0
    assert rel_err(launch.forward(shifted, k, v, "cog", 0.2)[0], out) < 1e-6
    q_t = q.transpose(-2, -1).contiguous().transpose(-2, -1)  # same values, other strides
    assert launch._stride_align(q_t) < launch._stride_align(q)
    assert rel_err(launch.forward(q_t, k, v, "cog", 0.2)[0], out) < 1e-6


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_eager_calls_run_the_custom_ops(monkeypatch, backend):
    """Eager calls, with and without gradients, go through the custom ops (the PyTorch path
    where its scores do not fit in one chunk)."""
    from uvic_kernels import torch_attention

    monkeypatch.setattr(torch_attention, "CHUNK_ELEMENTS", 33 * 16)
    ops = {}
    for name in ("_forward_op", "_backward_op"):
        ops[name] = _Calls(getattr(fused_attention, name))
        monkeypatch.setattr(fused_attention, name, ops[name])
    q, k, v, do = (randn(1, 2, 33, 16, seed=i) for i in range(4))
    out, grads = run(q, k, v, do, "cog", backend=backend)
    with torch.no_grad():
        assert torch.equal(attention(q, k, v, "cog", backend=backend), out)
    assert ops["_forward_op"].n == 2 and ops["_backward_op"].n == 1
    assert all(g.shape == x.shape for g, x in zip(grads, (q, k, v)))


@pytest.mark.parametrize("mode", MODES)
def test_torch_path_in_one_chunk_keeps_the_weights_and_agrees_with_the_chunks(monkeypatch,
                                                                               mode):
    """Where all scores fit at once the PyTorch path keeps the weights for the backward
    (`Materialised`, no custom op), a batch slice at a time; it agrees with itself in one
    slice, with the chunked path (recomputing them) and with the float64 reference,
    gradients (sigmoid's bias too) included."""
    from uvic_kernels import torch_attention

    q, k, v, do = (randn(3, 3, 37, 24, seed=i) for i in range(4))
    k, v = k[:, :, :29], v[:, :, :29]
    bias = torch.tensor([-1.0, 0.5, 2.0]) if mode == "sigmoid" else None
    calls = _Calls(fused_attention._forward_op)
    monkeypatch.setattr(fused_attention, "_forward_op", calls)
    kept = run(q, k, v, do, mode, backend="torch", bias=bias)
    assert calls.n == 0
    for items in (1, 2):  # batch items a slice (2: a last slice shorter than the others)
        monkeypatch.setattr(torch_attention, "CACHE_ELEMENTS", items * 3 * 37 * 29)
        sliced = run(q, k, v, do, mode, backend="torch", bias=bias)
        for a, b in zip([kept[0], *kept[1]], [sliced[0], *sliced[1]]):
            assert rel_err(a, b) < 1e-6
    monkeypatch.setattr(torch_attention, "CHUNK_ELEMENTS", 3 * 3 * 5 * 29)  # 8 chunks
    chunked = run(q, k, v, do, mode, backend="torch", bias=bias)
    assert calls.n == 1
    for a, b in zip([kept[0], *kept[1]], [chunked[0], *chunked[1]]):
        assert rel_err(a, b) < 1e-5
    leaves = [x.double().requires_grad_() for x in (q, k, v)]
    extra = {} if bias is None else {"bias": bias.double().requires_grad_()}
    out64 = REFERENCES[mode](*leaves, **extra)
    grads64 = torch.autograd.grad(out64, [*leaves, *extra.values()], do.double())
    for a, b in zip([kept[0], *kept[1]], [out64, *grads64]):
        assert rel_err(a, b) < 1e-5


@pytest.mark.parametrize("backend", ["triton", "torch", None])
def test_meta_and_fake_tensors(backend):
    """Meta tensors and fake tensors (shape inference, FLOP counting) take the custom ops'
    fake implementation: outputs and gradients of the right shapes, no kernel run."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    q = torch.randn(2, 3, 9, 16, device="meta", requires_grad=True)
    k = torch.randn(2, 3, 5, 16, device="meta", requires_grad=True)
    out = attention(q, k, k, "cog", backend=backend)
    out.sum().backward()
    assert out.shape == q.shape and q.grad.shape == q.shape and k.grad.shape == k.shape
    with torch.no_grad():
        assert attention(q, k, k, "cog", backend=backend).device.type == "meta"
    with FakeTensorMode():
        x = torch.randn(2, 3, 9, 16, requires_grad=True)
        out = attention(x, x, x, "expressive", backend=backend)
        out.sum().backward()
        assert out.shape == x.shape and x.grad.shape == x.shape
        b = torch.zeros(3, requires_grad=True)
        out = attention(x, x, x, "sigmoid", backend=backend, bias=b)
        out.sum().backward()
        assert out.shape == x.shape and b.grad.shape == b.shape


def test_gpu_config_pruning():
    """Tile selection on a GPU (pure Python, so it is checked here as well)."""
    import triton

    from uvic_kernels import tiles

    configs = [
        triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_stages=s, num_warps=w)
        for m, n, s, w in tiles.GPU_FWD_TILES
    ]

    def pruned(n_q, n_kv, dtype):
        args = {"Q": torch.empty(0, dtype=dtype), "N_Q": n_q, "N_KV": n_kv}
        return [(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"]) for c in tiles.prune(configs, args)]

    assert len(pruned(4096, 4096, torch.bfloat16)) == (len(configs) if tiles.AUTOTUNE else 1)
    assert all(m <= 64 and n <= 64 for m, n in pruned(40, 50, torch.float16))
    assert pruned(5, 5, torch.float16) == [(64, 32)]  # nothing fits: the smallest tile
    assert all(m * n <= tiles.FP32_MAX_TILE for m, n in pruned(4096, 4096, torch.float32))
    # without a GPU (no multiprocessor count) list order decides
    assert pruned(334, 334, torch.bfloat16)[0] == tiles.GPU_FWD_TILES[0][:2]


def test_default_backend(monkeypatch):
    """Triton on CUDA (and under the interpreter); elsewhere PyTorch's SDPA for softmax,
    the PyTorch path for the other modes."""
    x = torch.zeros(1, 1, 2, 16, device=DEVICE)
    if CUDA:
        assert fused_attention._backend_for(x, "cog") == "triton"
    else:
        assert os.environ["TRITON_INTERPRET"] == "1"
        assert fused_attention._backend_for(x, "cog") == "triton"
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        assert fused_attention._backend_for(x, "cog") == "torch"
        assert fused_attention._backend_for(x, "softmax") == "sdpa"
    meta = torch.zeros(1, 1, 2, 16, device="meta")
    assert [fused_attention._backend_for(meta, m) for m in ("cog", "softmax")] == ["torch",
                                                                                  "sdpa"]


# ---------------------------------------------------------------------------------------
# Input validation
# ---------------------------------------------------------------------------------------


def _bad_inputs():
    x = torch.zeros(1, 2, 8, 16)
    yield "ndim", (x[0], x, x), {}
    yield "shapes mismatch", (x, x, torch.zeros(1, 2, 9, 16)), {}
    yield "shapes mismatch", (x, torch.zeros(1, 3, 8, 16), torch.zeros(1, 3, 8, 16)), {}
    yield "mode", (x, x, x), {"mode": "linear"}
    yield "head dim", (torch.zeros(1, 1, 4, 129),) * 3, {}
    yield "dtype", (x.double(), x.double(), x.double()), {}
    yield "dtypes differ", (x, x.half(), x), {}
    yield "devices differ", (x, x, torch.zeros(1, 2, 8, 16, device="meta")), {}
    yield "scale", (x, x, x), {"scale": float("nan")}
    yield "backend", (x, x, x), {"backend": "cuda"}
    yield "at least one key", (x, x[:, :, :0], x[:, :, :0]), {}
    yield "takes none", (x, x, x), {"mode": "cog", "bias": -1.0}
    yield "bias must have shape", (x, x, x), {"mode": "sigmoid", "bias": torch.zeros(3)}
    yield "floating", (x, x, x), {"mode": "sigmoid", "bias": torch.zeros(2, dtype=torch.long)}
    yield "finite number", (x, x, x), {"mode": "sigmoid", "bias": float("inf")}
    yield "finite number", (x, x, x), {"mode": "sigmoid", "bias": "-log N"}


@pytest.mark.parametrize(("message", "args", "kwargs"), list(_bad_inputs()))
def test_input_validation(message, args, kwargs):
    with pytest.raises(ValueError, match=message):
        attention(*args, **kwargs)


def test_public_api():
    assert set(uvic_kernels.__all__) >= {
        "attention",
        "FusedAttention",
        "cog_attention_eq3",
        "cog_attention_reference",
        "softmax_attention_reference",
        "sigmoid_attention_reference",
    }


# ---------------------------------------------------------------------------------------
# Benchmark script
# ---------------------------------------------------------------------------------------


@pytest.mark.slow
def test_bench_smoke(tmp_path, capsys):
    from uvic_kernels import bench

    out = tmp_path / "kernels.json"
    assert bench.main(["--smoke", "--out", str(out)]) == 0
    payload = json.loads(out.read_text())
    assert payload["smoke"] and payload["results"]
    assert all(r["status"] == "ok" and r["max_abs_err"] < 1e-5 for r in payload["results"])
    assert "timings need a gpu" in capsys.readouterr().out.lower()


def test_bench_methods_filter(tmp_path, capsys):
    from uvic_kernels import bench

    out = tmp_path / "kernels.json"
    assert bench.main(["--smoke", "--methods", "cog eager", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["results"]
    assert [r["method"] for r in rows] == ["cog eager"]
    # each cell prints its row as it finishes, then the whole table follows
    assert capsys.readouterr().out.count("| cog eager |") == 2
    with pytest.raises(SystemExit) as exc:
        bench.main(["--smoke", "--methods", "cog eagre", "--out", str(out)])
    assert exc.value.code == 2
    assert "unknown method 'cog eagre'" in capsys.readouterr().err
