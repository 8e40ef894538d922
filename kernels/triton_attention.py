"""Fused softmax / Cog / expressive / sigmoid attention in Triton (FlashAttention-2 structure).

Per head, with scores ``S = scale * Q K^T`` and ``O = A V``: softmax ``A = softmax(S)``;
cog ``A = sign(S) * softmax(|S|)`` (sign(0) = 0); expressive ``A = E / rowsum(E)`` with
``E = S^2 / (1 + S^2)`` (an all-zero row gets A = 0); sigmoid ``A = sigmoid(S + b)``, no
row normalisation, one bias ``b`` per head.  ``MODE`` is a ``tl.constexpr``, so each mode
compiles to its own specialisation.  The forward keeps, per query row, with
``c = scale * log2(e) > 0`` (the host makes the scale positive)::

    x = q K_j^T;  t = |x| (cog) or x;  m' = max(m, c * rowmax(t));  p = exp2(c * t - m')
    l = l * exp2(m - m') + rowsum(p);  acc = acc * exp2(m - m') + (sign(x) * p or p) @ V_j
    O = acc / l;  LSE = (m + log2 l) * ln 2

Cog's running max starts at 0 (so l >= 1); expressive needs no max (each term is below 1)
and stores ``N = rowsum(E)`` instead of the LSE; sigmoid tiles are independent and read
the bias from that row-statistic buffer.  The backward recomputes A from the statistic,
with ``Delta = rowsum(dO * O)``: ``dS = A (dA - Delta)`` (softmax), ``sign(S) P (sign(S) dA
- Delta)`` (cog), ``(dA - Delta) / N * dE/dS`` (expressive), ``dA * A (1 - A)`` (sigmoid).
The derivations are in ``docs/cog_attention.md``, the tiling in :mod:`uvic_kernels.tiles`,
the launches in :mod:`uvic_kernels.launch`.  Tensors are (B, H, N, D) with any strides;
head dims that are not powers of two are padded to ``BLOCK_D`` with masked loads.
"""

from __future__ import annotations

import functools

import triton
import triton.language as tl
from triton.language.extra import libdevice

from uvic_kernels.tiles import (
    AUTOTUNE_KEY,
    INTERPRET,
    INTERPRET_BWD_DKDV,
    INTERPRET_BWD_DQ,
    INTERPRET_FWD,
    REMAINDER_COST,
    TAIL,
    configs,
    prune,
)

# fmt: off
# (kernel argument lists are grouped by tensor, one stride group per line, as in
# Triton's fused-attention tutorial; a formatter would put each on its own line)

LOG2E = 1.4426950408889634  # log2(e): exp(x) = exp2(x * LOG2E)
LN2 = 0.6931471805599453  # ln(2): converts a base-2 log-sum-exp to natural units
# Compiled kernels may only read globals that are tl.constexpr (the interpreter reads
# any global, so it does not catch this): device code uses these.
# The kernels' MODE constexpr: each mode compiles to its own specialisation.
MODE_IDS = {"softmax": 0, "cog": 1, "expressive": 2, "sigmoid": 3}
SOFTMAX_C = tl.constexpr(MODE_IDS["softmax"])
COG_C = tl.constexpr(MODE_IDS["cog"])
EXPRESSIVE_C = tl.constexpr(MODE_IDS["expressive"])
SIGMOID_C = tl.constexpr(MODE_IDS["sigmoid"])
LOG2E_C = tl.constexpr(LOG2E)
LN2_C = tl.constexpr(LN2)
TAIL_C = tl.constexpr(TAIL)
REMAINDER_COST_C = tl.constexpr(REMAINDER_COST)
INTERPRET_C = tl.constexpr(INTERPRET)


# --------------------------------------------------------------------------------------
# Device helpers
# --------------------------------------------------------------------------------------


@triton.jit
def _load_tile(ptrs, offs_a, bound_a, offs_b, bound_b, MASK_A: tl.constexpr, MASK_B: tl.constexpr):
    """Load a 2-D tile; positions with ``offs_a >= bound_a`` / ``offs_b >= bound_b`` read 0."""
    if MASK_A:
        if MASK_B:
            mask = (offs_a[:, None] < bound_a) & (offs_b[None, :] < bound_b)
            x = tl.load(ptrs, mask=mask, other=0.0)
        else:
            x = tl.load(ptrs, mask=offs_a[:, None] < bound_a, other=0.0)
    else:
        if MASK_B:
            x = tl.load(ptrs, mask=offs_b[None, :] < bound_b, other=0.0)
        else:
            x = tl.load(ptrs)
    return x


@triton.jit
def _times_sign_of(p, x):
    """``sign(x) * p`` for fp32 ``p >= 0`` (or NaN), with ``sign(0) = 0``.

    ``copysign(p, x)`` moves the sign bit of ``x`` onto ``p`` (one 3-input bitwise op
    on the GPU; as bit operations in the interpreter, which has no libdevice), and a
    compare and a select give 0 where ``x == 0``.  A NaN ``p`` stays NaN.
    """
    if INTERPRET_C:
        bits = p.to(tl.uint32, bitcast=True) | (x.to(tl.uint32, bitcast=True) & 0x80000000)
        signed = bits.to(tl.float32, bitcast=True)
    else:
        signed = libdevice.copysign(p, x)
    return tl.where(x == 0.0, 0.0, signed)


@triton.jit
def _inverse_normaliser(n):
    """1 / N for expressive attention's row sums, 0 where N = 0 (an all-zero row)."""
    return tl.where(n > 0.0, 1.0 / tl.where(n > 0.0, n, 1.0), 0.0)


@triton.jit
def _sigmoid_log2(u):
    """``(sigmoid(z), sigmoid(z) * (1 - sigmoid(z)))`` for ``u = z * log2(e)``, stable for
    any ``u``: ``t = exp2(-|u|)`` never overflows, and the slope ``t / (1 + t)^2`` keeps
    its relative accuracy where the weight rounds to 1.  A NaN ``u`` gives NaN."""
    t = tl.math.exp2(-tl.abs(u))
    r = tl.fdiv(tl.full(u.shape, 1.0, tl.float32), 1.0 + t)
    tr = t * r
    return tl.where(u >= 0.0, r, tr), tr * r


@triton.jit
def _head_offset(off_hz, H, stride_z, stride_h, STRIDE_ALIGN: tl.constexpr):
    """Element offset of head ``off_hz`` (flattened B*H index), in int64.

    ``stride_z`` / ``stride_h`` arrive divided by ``STRIDE_ALIGN`` (see
    ``uvic_kernels.launch._stride_align``).
    """
    off_z = (off_hz // H).to(tl.int64)
    off_h = (off_hz % H).to(tl.int64)
    return (off_z * stride_z + off_h * stride_h) * STRIDE_ALIGN


@triton.jit
def _program_block(pid, N, BLOCK: tl.constexpr):
    """Split a 1-D program id into ``(head, first row, is_full, big_remainder)``.

    A 1-D grid fits any number of heads, and consecutive programs share a head (K and V
    stay in L2).  Each head has ``N // BLOCK`` full-block programs followed by its remainder
    programs (``uvic_kernels.tiles.remainder``): ``cdiv(N % BLOCK, TAIL)`` programs of
    ``TAIL`` rows, or, when ``big_remainder``, one masked program of ``BLOCK`` rows.
    """
    num_full = N // BLOCK
    n_tail = tl.cdiv(N - num_full * BLOCK, TAIL_C)
    big_remainder = n_tail * TAIL_C * REMAINDER_COST_C > BLOCK
    per_head = num_full + tl.where(big_remainder, 1, n_tail)
    block = pid % per_head
    full = block < num_full
    start = tl.where(full, block * BLOCK, num_full * BLOCK + (block - num_full) * TAIL_C)
    return pid // per_head, start, full, big_remainder


# --------------------------------------------------------------------------------------
# Forward
# --------------------------------------------------------------------------------------


@triton.jit
def _attn_fwd_inner(
    acc, l_i, m_i, q, K_head, V_head, lo, hi, N_KV,
    stride_kn, stride_kd, stride_vn, stride_vd, qk_scale, offs_d,
    MODE: tl.constexpr, MASK_N: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Online softmax over keys [lo, hi) in steps of BLOCK_N; MASK_N masks keys >= N_KV.

    Sigmoid mode reads its per-row bias (log2 units) from ``m_i`` and leaves ``l_i`` as is.
    """
    PAD_D: tl.constexpr = BLOCK_D != HEAD_DIM
    offs_n = tl.arange(0, BLOCK_N)
    kT_ptrs = K_head + offs_d[:, None] * stride_kd + offs_n[None, :] * stride_kn
    v_ptrs = V_head + offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vd
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        kT = _load_tile(kT_ptrs + start_n * stride_kn, offs_d, HEAD_DIM, cols, N_KV, PAD_D, MASK_N)
        x = tl.dot(q, kT, input_precision=DOT_PRECISION)  # raw q.k; s = x * scale
        if MODE == SIGMOID_C:
            # m_i holds the rows' bias in log2 units (qk_scale = scale * log2(e)); masked
            # keys read k = 0, whose weight sigmoid(b) is not 0: they are zeroed
            p, _ = _sigmoid_log2(x * qk_scale + m_i[:, None])
            if MASK_N:
                p = tl.where(cols[None, :] < N_KV, p, 0.0)
            v = _load_tile(v_ptrs + start_n * stride_vn, cols, N_KV, offs_d, HEAD_DIM, MASK_N,
                           PAD_D)
            acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
        elif MODE == EXPRESSIVE_C:
            # e = s^2 / (1 + s^2) in [0, 1) (qk_scale = scale^2): no running max and no
            # rescaling; masked keys read k = 0, so x = 0 and e = 0 there
            z2 = x * x * qk_scale
            p = tl.fdiv(z2, 1.0 + z2)
            v = _load_tile(v_ptrs + start_n * stride_vn, cols, N_KV, offs_d, HEAD_DIM, MASK_N,
                           PAD_D)
            l_i = l_i + tl.sum(p, 1)
            acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
        else:
            if MODE == COG_C:
                # masked keys read k = 0, so x = 0 there: neutral for the running max of
                # |x| (which starts at 0) and weight sign(0) * p = 0; only the row sum
                # below must leave them out
                m_new = tl.maximum(m_i, tl.max(tl.abs(x), 1) * qk_scale)
                p = tl.math.exp2(tl.abs(x) * qk_scale - m_new[:, None])
            else:
                if MASK_N:
                    x = tl.where(cols[None, :] < N_KV, x, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(x, 1) * qk_scale)
                p = tl.math.exp2(x * qk_scale - m_new[:, None])
            if MASK_N:
                # masked keys contribute neither to the denominator nor to the output
                p = tl.where(cols[None, :] < N_KV, p, 0.0)
            v = _load_tile(v_ptrs + start_n * stride_vn, cols, N_KV, offs_d, HEAD_DIM, MASK_N,
                           PAD_D)
            if MODE == COG_C:
                # sign(s) * exp(|s| - m), formed (and rounded to V's dtype) before the row
                # sum so that x dies here: x, p and the weights are never all live at once
                a = _times_sign_of(p, x).to(v.dtype)
            else:
                a = p.to(v.dtype)
            alpha = tl.math.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None]
            acc = tl.dot(a, v, acc, input_precision=DOT_PRECISION)
            m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _attn_fwd_block(
    Q_head, K_head, V_head, O_head, Lse_head, start_m, N_Q, N_KV,
    stride_qm, stride_qd, stride_kn, stride_kd, stride_vn, stride_vd, stride_om, stride_od,
    qk_scale,
    MODE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    MASK_M: tl.constexpr,
):
    """O and LSE of query rows [start_m, start_m + BLOCK_M); MASK_M masks rows >= N_Q."""
    PAD_D: tl.constexpr = BLOCK_D != HEAD_DIM
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    q = _load_tile(Q_head + offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qd,
                   offs_m, N_Q, offs_d, HEAD_DIM, MASK_M, PAD_D)
    if MODE == SOFTMAX_C:
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    elif MODE == SIGMOID_C:
        # the rows' bias, written by the host where the other modes store their statistic
        if MASK_M:
            m_i = tl.load(Lse_head + offs_m, mask=offs_m < N_Q, other=0.0) * LOG2E_C
        else:
            m_i = tl.load(Lse_head + offs_m) * LOG2E_C
    else:
        m_i = tl.zeros([BLOCK_M], dtype=tl.float32)  # cog: max |s| >= 0; expressive: unused
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    # full key blocks, then the remainder in TAIL-wide steps (the last one masked)
    n_full = (N_KV // BLOCK_N) * BLOCK_N
    n_tail = (N_KV // TAIL_C) * TAIL_C
    acc, l_i, m_i = _attn_fwd_inner(
        acc, l_i, m_i, q, K_head, V_head, 0, n_full, N_KV,
        stride_kn, stride_kd, stride_vn, stride_vd, qk_scale, offs_d,
        MODE, False, HEAD_DIM, BLOCK_D, BLOCK_N, DOT_PRECISION,
    )
    acc, l_i, m_i = _attn_fwd_inner(
        acc, l_i, m_i, q, K_head, V_head, n_full, n_tail, N_KV,
        stride_kn, stride_kd, stride_vn, stride_vd, qk_scale, offs_d,
        MODE, False, HEAD_DIM, BLOCK_D, TAIL_C, DOT_PRECISION,
    )
    acc, l_i, m_i = _attn_fwd_inner(
        acc, l_i, m_i, q, K_head, V_head, n_tail, N_KV, N_KV,
        stride_kn, stride_kd, stride_vn, stride_vd, qk_scale, offs_d,
        MODE, True, HEAD_DIM, BLOCK_D, TAIL_C, DOT_PRECISION,
    )

    if MODE == EXPRESSIVE_C:
        # a row whose scores are all exactly 0 has N = 0: its weights are defined as 0
        acc = acc * _inverse_normaliser(l_i)[:, None]
        lse = l_i  # expressive stores the row normaliser N, not a log-sum-exp
    elif MODE == SIGMOID_C:
        lse = l_i  # not stored: the bias stays where the host wrote it
    else:
        acc = acc / l_i[:, None]
        lse = (m_i + tl.math.log2(l_i)) * LN2_C
    o_ptrs = O_head + offs_m[:, None] * stride_om + offs_d[None, :] * stride_od
    if MASK_M:
        if MODE != SIGMOID_C:
            tl.store(Lse_head + offs_m, lse, mask=offs_m < N_Q)
        o_mask = offs_m[:, None] < N_Q
        if PAD_D:
            o_mask = o_mask & (offs_d[None, :] < HEAD_DIM)
        tl.store(o_ptrs, acc.to(O_head.dtype.element_ty), mask=o_mask)
    else:
        if MODE != SIGMOID_C:
            tl.store(Lse_head + offs_m, lse)
        if PAD_D:
            tl.store(o_ptrs, acc.to(O_head.dtype.element_ty), mask=offs_d[None, :] < HEAD_DIM)
        else:
            tl.store(o_ptrs, acc.to(O_head.dtype.element_ty))


@triton.autotune(
    configs=configs(INTERPRET_FWD, "fwd"),
    key=AUTOTUNE_KEY,
    prune_configs_by={"early_config_prune": functools.partial(prune, kind="fwd")},
)
@triton.jit
def _attn_fwd(
    Q, K, V, Out, Lse,
    stride_qz, stride_qh, stride_qm, stride_qd,
    stride_kz, stride_kh, stride_kn, stride_kd,
    stride_vz, stride_vh, stride_vn, stride_vd,
    stride_oz, stride_oh, stride_om, stride_od,
    H, BH, N_Q, N_KV, qk_scale,
    MODE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, STRIDE_ALIGN: tl.constexpr,
    DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """O and the row LSE for one (head, query block) or one remainder program.

    Only O and the fp32 row statistic are written: O(N) extra memory."""
    stride_qm, stride_kn, stride_vn, stride_om = (
        stride_qm * STRIDE_ALIGN, stride_kn * STRIDE_ALIGN, stride_vn * STRIDE_ALIGN,
        stride_om * STRIDE_ALIGN)
    off_hz, start, full, big_remainder = _program_block(tl.program_id(0), N_Q, BLOCK_M)
    Q_head = Q + _head_offset(off_hz, H, stride_qz, stride_qh, STRIDE_ALIGN)
    K_head = K + _head_offset(off_hz, H, stride_kz, stride_kh, STRIDE_ALIGN)
    V_head = V + _head_offset(off_hz, H, stride_vz, stride_vh, STRIDE_ALIGN)
    O_head = Out + _head_offset(off_hz, H, stride_oz, stride_oh, STRIDE_ALIGN)
    Lse_head = Lse + off_hz.to(tl.int64) * N_Q
    if full:
        _attn_fwd_block(
            Q_head, K_head, V_head, O_head, Lse_head, start, N_Q, N_KV,
            stride_qm, stride_qd, stride_kn, stride_kd, stride_vn, stride_vd, stride_om, stride_od,
            qk_scale, MODE, HEAD_DIM, BLOCK_D, DOT_PRECISION, BLOCK_M, BLOCK_N, False,
        )
    elif big_remainder:
        _attn_fwd_block(
            Q_head, K_head, V_head, O_head, Lse_head, start, N_Q, N_KV,
            stride_qm, stride_qd, stride_kn, stride_kd, stride_vn, stride_vd, stride_om, stride_od,
            qk_scale, MODE, HEAD_DIM, BLOCK_D, DOT_PRECISION, BLOCK_M, BLOCK_N, True,
        )
    else:
        _attn_fwd_block(
            Q_head, K_head, V_head, O_head, Lse_head, start, N_Q, N_KV,
            stride_qm, stride_qd, stride_kn, stride_kd, stride_vn, stride_vd, stride_om, stride_od,
            qk_scale, MODE, HEAD_DIM, BLOCK_D, DOT_PRECISION, TAIL_C, BLOCK_N, True,
        )


# --------------------------------------------------------------------------------------
# Backward
# --------------------------------------------------------------------------------------


@triton.jit
def _attn_bwd_preprocess(
    O, DO, Delta,
    stride_oz, stride_oh, stride_om, stride_od,
    stride_dz, stride_dh, stride_dm, stride_dd,
    H, N_Q,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, STRIDE_ALIGN: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    """Delta = rowsum(dO * O) in fp32 (only when dQ is not computed: the dQ kernel
    computes Delta itself)."""
    PAD_D: tl.constexpr = BLOCK_D != HEAD_DIM
    stride_om, stride_dm = stride_om * STRIDE_ALIGN, stride_dm * STRIDE_ALIGN
    pid = tl.program_id(0)
    num_m = tl.cdiv(N_Q, BLOCK_M)
    off_hz = pid // num_m
    offs_m = (pid % num_m) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    o_ptrs = (O + _head_offset(off_hz, H, stride_oz, stride_oh, STRIDE_ALIGN)
              + offs_m[:, None] * stride_om + offs_d[None, :] * stride_od)
    do_ptrs = (DO + _head_offset(off_hz, H, stride_dz, stride_dh, STRIDE_ALIGN)
               + offs_m[:, None] * stride_dm + offs_d[None, :] * stride_dd)
    o = _load_tile(o_ptrs, offs_m, N_Q, offs_d, HEAD_DIM, True, PAD_D).to(tl.float32)
    do = _load_tile(do_ptrs, offs_m, N_Q, offs_d, HEAD_DIM, True, PAD_D).to(tl.float32)
    delta = tl.sum(o * do, 1)
    tl.store(Delta + off_hz.to(tl.int64) * N_Q + offs_m, delta, mask=offs_m < N_Q)


@triton.jit
def _attn_bwd_dkdv_inner(
    dk, dv, k, v, Q_head, DO_head, Lse_head, Delta_head, lo, hi, N_Q,
    stride_qm, stride_qd, stride_dom, stride_dod, qk_scale, offs_d,
    MODE: tl.constexpr, MASK_M: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Accumulate dK and dV of one key block over queries [lo, hi) in steps of BLOCK_M.

    Masked query rows (MASK_M) read q = dO = 0, LSE = Delta = 0: their weights are
    sign(0) * P = 0 (cog) or exp(0) = 1 (softmax) against dO = 0 and dA = 0, so they
    add exactly 0 to dV and dK without a select.
    """
    PAD_D: tl.constexpr = BLOCK_D != HEAD_DIM
    offs_m = tl.arange(0, BLOCK_M)
    qT_ptrs = Q_head + offs_d[:, None] * stride_qd + offs_m[None, :] * stride_qm
    do_ptrs = DO_head + offs_m[:, None] * stride_dom + offs_d[None, :] * stride_dod
    for start_m in range(lo, hi, BLOCK_M):
        rows = start_m + offs_m
        qT = _load_tile(qT_ptrs + start_m * stride_qm, offs_d, HEAD_DIM, rows, N_Q, PAD_D, MASK_M)
        do = _load_tile(do_ptrs + start_m * stride_dom, rows, N_Q, offs_d, HEAD_DIM, MASK_M, PAD_D)
        if MASK_M:
            lse = tl.load(Lse_head + rows, mask=rows < N_Q, other=0.0)
        else:
            lse = tl.load(Lse_head + rows)
        if MODE == SIGMOID_C:
            delta = tl.zeros([BLOCK_M], dtype=tl.float32)  # no Delta term in sigmoid's dS
        elif MASK_M:
            delta = tl.load(Delta_head + rows, mask=rows < N_Q, other=0.0)
        else:
            delta = tl.load(Delta_head + rows)
        # transposed raw products (keys x queries); s = x * scale
        xT = tl.dot(k, qT, input_precision=DOT_PRECISION)
        if MODE == SIGMOID_C:
            # lse holds the rows' bias (natural units); masked rows read q = dO = 0, so
            # their weight sigmoid(0) meets dO = 0 and dA = 0
            aT, slopeT = _sigmoid_log2(xT * qk_scale + lse[None, :] * LOG2E_C)
        elif MODE == EXPRESSIVE_C:
            inv_n = _inverse_normaliser(lse)
            z2 = xT * xT * qk_scale
            r = tl.fdiv(tl.full(z2.shape, 1.0, tl.float32), 1.0 + z2)  # 1 / (1 + s^2)
            aT = z2 * r * inv_n[None, :]
        elif MODE == COG_C:
            # A^T = sign(S) * P directly, so that only one score-sized tile stays live
            aT = _times_sign_of(
                tl.math.exp2(tl.abs(xT) * qk_scale - lse[None, :] * LOG2E_C), xT)
        else:
            aT = tl.math.exp2(xT * qk_scale - lse[None, :] * LOG2E_C)
        dv = tl.dot(aT.to(do.dtype), do, dv, input_precision=DOT_PRECISION)  # dV += A^T dO
        dpT = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)  # dA^T = V dO^T
        if MODE == SIGMOID_C:
            dsT = dpT * slopeT  # dA * A * (1 - A)
        elif MODE == EXPRESSIVE_C:
            # dL/dx = (dA - Delta) / N * de/dx, de/dx = 2 scale^2 x / (1 + s^2)^2; the
            # constant 2 scale^2 is applied once to dK (sm_scale)
            dsT = (dpT - delta[None, :]) * (inv_n[None, :] * xT * r * r)
        elif MODE == COG_C:
            # = sign(S) * P * (sign(S) * dA - Delta), as |A| = |sign(S)| * P: one tile live
            # instead of P and sign(S), and exactly 0 where S == 0 as autograd gives (the
            # algebraically equal P * dA - A * Delta is not)
            dsT = tl.abs(aT) * dpT - aT * delta[None, :]
        else:
            dsT = aT * (dpT - delta[None, :])
        dk = tl.dot(dsT.to(qT.dtype), tl.trans(qT), dk, input_precision=DOT_PRECISION)
    return dk, dv


@triton.jit
def _attn_bwd_dkdv_block(
    Q_head, K_head, V_head, DO_head, DK_head, DV_head, Lse_head, Delta_head, start_n, N_Q, N_KV,
    stride_qm, stride_qd, stride_kn, stride_kd, stride_vn, stride_vd,
    stride_dom, stride_dod, stride_dkn, stride_dkd, stride_dvn, stride_dvd,
    sm_scale, qk_scale,
    MODE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    MASK_N: tl.constexpr,
):
    """dK, dV of keys [start_n, start_n + BLOCK_N); MASK_N masks keys >= N_KV."""
    PAD_D: tl.constexpr = BLOCK_D != HEAD_DIM
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    k = _load_tile(K_head + offs_n[:, None] * stride_kn + offs_d[None, :] * stride_kd,
                   offs_n, N_KV, offs_d, HEAD_DIM, MASK_N, PAD_D)
    v = _load_tile(V_head + offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vd,
                   offs_n, N_KV, offs_d, HEAD_DIM, MASK_N, PAD_D)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)

    # full query blocks, then the remainder in TAIL-wide steps (the last one masked)
    m_full = (N_Q // BLOCK_M) * BLOCK_M
    m_tail = (N_Q // TAIL_C) * TAIL_C
    dk, dv = _attn_bwd_dkdv_inner(
        dk, dv, k, v, Q_head, DO_head, Lse_head, Delta_head, 0, m_full, N_Q,
        stride_qm, stride_qd, stride_dom, stride_dod, qk_scale, offs_d,
        MODE, False, HEAD_DIM, BLOCK_D, BLOCK_M, DOT_PRECISION,
    )
    dk, dv = _attn_bwd_dkdv_inner(
        dk, dv, k, v, Q_head, DO_head, Lse_head, Delta_head, m_full, m_tail, N_Q,
        stride_qm, stride_qd, stride_dom, stride_dod, qk_scale, offs_d,
        MODE, False, HEAD_DIM, BLOCK_D, TAIL_C, DOT_PRECISION,
    )
    dk, dv = _attn_bwd_dkdv_inner(
        dk, dv, k, v, Q_head, DO_head, Lse_head, Delta_head, m_tail, N_Q, N_Q,
        stride_qm, stride_qd, stride_dom, stride_dod, qk_scale, offs_d,
        MODE, True, HEAD_DIM, BLOCK_D, TAIL_C, DOT_PRECISION,
    )
    dk = dk * sm_scale

    dk_ptrs = DK_head + offs_n[:, None] * stride_dkn + offs_d[None, :] * stride_dkd
    dv_ptrs = DV_head + offs_n[:, None] * stride_dvn + offs_d[None, :] * stride_dvd
    if MASK_N:
        mask = offs_n[:, None] < N_KV
        if PAD_D:
            mask = mask & (offs_d[None, :] < HEAD_DIM)
        tl.store(dk_ptrs, dk.to(DK_head.dtype.element_ty), mask=mask)
        tl.store(dv_ptrs, dv.to(DV_head.dtype.element_ty), mask=mask)
    elif PAD_D:
        tl.store(dk_ptrs, dk.to(DK_head.dtype.element_ty), mask=offs_d[None, :] < HEAD_DIM)
        tl.store(dv_ptrs, dv.to(DV_head.dtype.element_ty), mask=offs_d[None, :] < HEAD_DIM)
    else:
        tl.store(dk_ptrs, dk.to(DK_head.dtype.element_ty))
        tl.store(dv_ptrs, dv.to(DV_head.dtype.element_ty))


@triton.autotune(
    configs=configs(INTERPRET_BWD_DKDV, "dkdv"),
    key=AUTOTUNE_KEY,
    prune_configs_by={"early_config_prune": functools.partial(prune, kind="dkdv")},
)
@triton.jit
def _attn_bwd_dkdv(
    Q, K, V, DO, DK, DV, Lse, Delta,
    stride_qz, stride_qh, stride_qm, stride_qd,
    stride_kz, stride_kh, stride_kn, stride_kd,
    stride_vz, stride_vh, stride_vn, stride_vd,
    stride_doz, stride_doh, stride_dom, stride_dod,
    stride_dkz, stride_dkh, stride_dkn, stride_dkd,
    stride_dvz, stride_dvh, stride_dvn, stride_dvd,
    H, BH, N_Q, N_KV, sm_scale, qk_scale,
    MODE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, STRIDE_ALIGN: tl.constexpr,
    DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """dK and dV for one (head, key block) or one remainder program; runs after
    ``_attn_bwd_dq`` (which writes Delta).  No atomics: results are bit-identical run to run."""
    stride_qm, stride_kn, stride_vn, stride_dom, stride_dkn, stride_dvn = (
        stride_qm * STRIDE_ALIGN, stride_kn * STRIDE_ALIGN, stride_vn * STRIDE_ALIGN,
        stride_dom * STRIDE_ALIGN, stride_dkn * STRIDE_ALIGN, stride_dvn * STRIDE_ALIGN)
    off_hz, start, full, big_remainder = _program_block(tl.program_id(0), N_KV, BLOCK_N)
    Q_head = Q + _head_offset(off_hz, H, stride_qz, stride_qh, STRIDE_ALIGN)
    K_head = K + _head_offset(off_hz, H, stride_kz, stride_kh, STRIDE_ALIGN)
    V_head = V + _head_offset(off_hz, H, stride_vz, stride_vh, STRIDE_ALIGN)
    DO_head = DO + _head_offset(off_hz, H, stride_doz, stride_doh, STRIDE_ALIGN)
    DK_head = DK + _head_offset(off_hz, H, stride_dkz, stride_dkh, STRIDE_ALIGN)
    DV_head = DV + _head_offset(off_hz, H, stride_dvz, stride_dvh, STRIDE_ALIGN)
    Lse_head = Lse + off_hz.to(tl.int64) * N_Q
    Delta_head = Delta + off_hz.to(tl.int64) * N_Q
    if full:
        _attn_bwd_dkdv_block(
            Q_head, K_head, V_head, DO_head, DK_head, DV_head, Lse_head, Delta_head,
            start, N_Q, N_KV,
            stride_qm, stride_qd, stride_kn, stride_kd, stride_vn, stride_vd,
            stride_dom, stride_dod, stride_dkn, stride_dkd, stride_dvn, stride_dvd,
            sm_scale, qk_scale, MODE, HEAD_DIM, BLOCK_D, DOT_PRECISION, BLOCK_M, BLOCK_N, False,
        )
    elif big_remainder:
        _attn_bwd_dkdv_block(
            Q_head, K_head, V_head, DO_head, DK_head, DV_head, Lse_head, Delta_head,
            start, N_Q, N_KV,
            stride_qm, stride_qd, stride_kn, stride_kd, stride_vn, stride_vd,
            stride_dom, stride_dod, stride_dkn, stride_dkd, stride_dvn, stride_dvd,
            sm_scale, qk_scale, MODE, HEAD_DIM, BLOCK_D, DOT_PRECISION, BLOCK_M, BLOCK_N, True,
        )
    else:
        _attn_bwd_dkdv_block(
            Q_head, K_head, V_head, DO_head, DK_head, DV_head, Lse_head, Delta_head,
            start, N_Q, N_KV,
            stride_qm, stride_qd, stride_kn, stride_kd, stride_vn, stride_vd,
            stride_dom, stride_dod, stride_dkn, stride_dkd, stride_dvn, stride_dvd,
            sm_scale, qk_scale, MODE, HEAD_DIM, BLOCK_D, DOT_PRECISION, BLOCK_M, TAIL_C, True,
        )


@triton.jit
def _attn_bwd_dq_inner(
    dq, ds_sum, q, do, lse, delta, K_head, V_head, lo, hi, N_KV,
    stride_kn, stride_kd, stride_vn, stride_vd, qk_scale, offs_d,
    MODE: tl.constexpr, MASK_N: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Accumulate dQ of one query block over keys [lo, hi) in steps of BLOCK_N, and in
    sigmoid mode the row sums of dS (``ds_sum``, the bias gradient).

    Masked keys (MASK_N) read k = v = 0: they add ds * 0 to dQ.  In Cog mode their
    weight is sign(0) * P = 0 already; in softmax mode it is exp(-LSE), which can
    overflow for very negative rows, so it is zeroed explicitly.
    """
    PAD_D: tl.constexpr = BLOCK_D != HEAD_DIM
    offs_n = tl.arange(0, BLOCK_N)
    kT_ptrs = K_head + offs_d[:, None] * stride_kd + offs_n[None, :] * stride_kn
    vT_ptrs = V_head + offs_d[:, None] * stride_vd + offs_n[None, :] * stride_vn
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        kT = _load_tile(kT_ptrs + start_n * stride_kn, offs_d, HEAD_DIM, cols, N_KV, PAD_D, MASK_N)
        vT = _load_tile(vT_ptrs + start_n * stride_vn, offs_d, HEAD_DIM, cols, N_KV, PAD_D, MASK_N)
        x = tl.dot(q, kT, input_precision=DOT_PRECISION)  # raw q.k; s = x * scale
        if MODE == SIGMOID_C:
            # lse holds the rows' bias in log2 units; masked keys read v = 0, so dA = 0
            _, slope = _sigmoid_log2(x * qk_scale + lse[:, None])
        elif MODE == EXPRESSIVE_C:
            # lse holds 1 / N here (see _attn_bwd_dq_block); masked keys give x = 0
            z2 = x * x * qk_scale
            r = tl.fdiv(tl.full(z2.shape, 1.0, tl.float32), 1.0 + z2)  # 1 / (1 + s^2)
        elif MODE == COG_C:
            a = _times_sign_of(tl.math.exp2(tl.abs(x) * qk_scale - lse[:, None]), x)
        else:
            a = tl.math.exp2(x * qk_scale - lse[:, None])
            if MASK_N:
                a = tl.where(cols[None, :] < N_KV, a, 0.0)
        dp = tl.dot(do, vT, input_precision=DOT_PRECISION)  # dA = dO V^T
        if MODE == SIGMOID_C:
            ds = dp * slope  # dA * A * (1 - A)
            ds_sum += tl.sum(ds, 1)
        elif MODE == EXPRESSIVE_C:
            ds = (dp - delta[:, None]) * (lse[:, None] * x * r * r)  # times 2 scale^2 later
        elif MODE == COG_C:
            ds = tl.abs(a) * dp - a * delta[:, None]  # = sign(S) * P * (sign(S) * dA - Delta)
        else:
            ds = a * (dp - delta[:, None])
        dq = tl.dot(ds.to(kT.dtype), tl.trans(kT), dq, input_precision=DOT_PRECISION)
    return dq, ds_sum


@triton.jit
def _attn_bwd_dq_block(
    Q_head, K_head, V_head, O_head, DO_head, DQ_head, Lse_head, Delta_head, start_m, N_Q, N_KV,
    stride_qm, stride_qd, stride_kn, stride_kd, stride_vn, stride_vd,
    stride_om, stride_od, stride_dom, stride_dod, stride_dqm, stride_dqd,
    sm_scale, qk_scale,
    MODE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    MASK_M: tl.constexpr,
):
    """dQ and Delta (sigmoid: the row sums of dS) of query rows [start_m, start_m + BLOCK_M);
    MASK_M masks rows >= N_Q."""
    PAD_D: tl.constexpr = BLOCK_D != HEAD_DIM
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    q = _load_tile(Q_head + offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qd,
                   offs_m, N_Q, offs_d, HEAD_DIM, MASK_M, PAD_D)
    do = _load_tile(DO_head + offs_m[:, None] * stride_dom + offs_d[None, :] * stride_dod,
                    offs_m, N_Q, offs_d, HEAD_DIM, MASK_M, PAD_D)
    if MODE == SIGMOID_C:
        delta = tl.zeros([BLOCK_M], dtype=tl.float32)  # no Delta term; O is not read
    else:
        o = _load_tile(O_head + offs_m[:, None] * stride_om + offs_d[None, :] * stride_od,
                       offs_m, N_Q, offs_d, HEAD_DIM, MASK_M, PAD_D)
        # Delta = rowsum(dO * O), here because this program holds dO anyway; stored for
        # the dK/dV kernel, which runs next
        delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
        if MASK_M:
            tl.store(Delta_head + offs_m, delta, mask=offs_m < N_Q)
        else:
            tl.store(Delta_head + offs_m, delta)
    if MASK_M:
        lse = tl.load(Lse_head + offs_m, mask=offs_m < N_Q, other=0.0)
    else:
        lse = tl.load(Lse_head + offs_m)
    # the row statistic the inner loop needs: LSE in log2 units, or 1 / N (expressive)
    if MODE == EXPRESSIVE_C:
        row_stat = _inverse_normaliser(lse)
    else:
        row_stat = lse * LOG2E_C
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    ds_sum = tl.zeros([BLOCK_M], dtype=tl.float32)  # sigmoid: row sums of dS

    # full key blocks, then the remainder in TAIL-wide steps (the last one masked)
    n_full = (N_KV // BLOCK_N) * BLOCK_N
    n_tail = (N_KV // TAIL_C) * TAIL_C
    dq, ds_sum = _attn_bwd_dq_inner(
        dq, ds_sum, q, do, row_stat, delta, K_head, V_head, 0, n_full, N_KV,
        stride_kn, stride_kd, stride_vn, stride_vd, qk_scale, offs_d,
        MODE, False, HEAD_DIM, BLOCK_D, BLOCK_N, DOT_PRECISION,
    )
    dq, ds_sum = _attn_bwd_dq_inner(
        dq, ds_sum, q, do, row_stat, delta, K_head, V_head, n_full, n_tail, N_KV,
        stride_kn, stride_kd, stride_vn, stride_vd, qk_scale, offs_d,
        MODE, False, HEAD_DIM, BLOCK_D, TAIL_C, DOT_PRECISION,
    )
    dq, ds_sum = _attn_bwd_dq_inner(
        dq, ds_sum, q, do, row_stat, delta, K_head, V_head, n_tail, N_KV, N_KV,
        stride_kn, stride_kd, stride_vn, stride_vd, qk_scale, offs_d,
        MODE, True, HEAD_DIM, BLOCK_D, TAIL_C, DOT_PRECISION,
    )
    dq = dq * sm_scale
    if MODE == SIGMOID_C:
        # the rows' share of the bias gradient, where the other modes keep Delta
        if MASK_M:
            tl.store(Delta_head + offs_m, ds_sum, mask=offs_m < N_Q)
        else:
            tl.store(Delta_head + offs_m, ds_sum)

    dq_ptrs = DQ_head + offs_m[:, None] * stride_dqm + offs_d[None, :] * stride_dqd
    if MASK_M:
        mask = offs_m[:, None] < N_Q
        if PAD_D:
            mask = mask & (offs_d[None, :] < HEAD_DIM)
        tl.store(dq_ptrs, dq.to(DQ_head.dtype.element_ty), mask=mask)
    elif PAD_D:
        tl.store(dq_ptrs, dq.to(DQ_head.dtype.element_ty), mask=offs_d[None, :] < HEAD_DIM)
    else:
        tl.store(dq_ptrs, dq.to(DQ_head.dtype.element_ty))


@triton.autotune(
    configs=configs(INTERPRET_BWD_DQ, "dq"),
    key=AUTOTUNE_KEY,
    prune_configs_by={"early_config_prune": functools.partial(prune, kind="dq")},
)
@triton.jit
def _attn_bwd_dq(
    Q, K, V, O, DO, DQ, Lse, Delta,
    stride_qz, stride_qh, stride_qm, stride_qd,
    stride_kz, stride_kh, stride_kn, stride_kd,
    stride_vz, stride_vh, stride_vn, stride_vd,
    stride_oz, stride_oh, stride_om, stride_od,
    stride_doz, stride_doh, stride_dom, stride_dod,
    stride_dqz, stride_dqh, stride_dqm, stride_dqd,
    H, BH, N_Q, N_KV, sm_scale, qk_scale,
    MODE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, STRIDE_ALIGN: tl.constexpr,
    DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """dQ (and Delta) for one (head, query block) or one remainder program; it computes
    Delta for its rows because it holds dO anyway, so Delta costs no pass of its own."""
    stride_qm, stride_kn, stride_vn, stride_om, stride_dom, stride_dqm = (
        stride_qm * STRIDE_ALIGN, stride_kn * STRIDE_ALIGN, stride_vn * STRIDE_ALIGN,
        stride_om * STRIDE_ALIGN, stride_dom * STRIDE_ALIGN, stride_dqm * STRIDE_ALIGN)
    off_hz, start, full, big_remainder = _program_block(tl.program_id(0), N_Q, BLOCK_M)
    Q_head = Q + _head_offset(off_hz, H, stride_qz, stride_qh, STRIDE_ALIGN)
    K_head = K + _head_offset(off_hz, H, stride_kz, stride_kh, STRIDE_ALIGN)
    V_head = V + _head_offset(off_hz, H, stride_vz, stride_vh, STRIDE_ALIGN)
    O_head = O + _head_offset(off_hz, H, stride_oz, stride_oh, STRIDE_ALIGN)
    DO_head = DO + _head_offset(off_hz, H, stride_doz, stride_doh, STRIDE_ALIGN)
    DQ_head = DQ + _head_offset(off_hz, H, stride_dqz, stride_dqh, STRIDE_ALIGN)
    Lse_head = Lse + off_hz.to(tl.int64) * N_Q
    Delta_head = Delta + off_hz.to(tl.int64) * N_Q
    if full:
        _attn_bwd_dq_block(
            Q_head, K_head, V_head, O_head, DO_head, DQ_head, Lse_head, Delta_head,
            start, N_Q, N_KV,
            stride_qm, stride_qd, stride_kn, stride_kd, stride_vn, stride_vd,
            stride_om, stride_od, stride_dom, stride_dod, stride_dqm, stride_dqd,
            sm_scale, qk_scale, MODE, HEAD_DIM, BLOCK_D, DOT_PRECISION, BLOCK_M, BLOCK_N, False,
        )
    elif big_remainder:
        _attn_bwd_dq_block(
            Q_head, K_head, V_head, O_head, DO_head, DQ_head, Lse_head, Delta_head,
            start, N_Q, N_KV,
            stride_qm, stride_qd, stride_kn, stride_kd, stride_vn, stride_vd,
            stride_om, stride_od, stride_dom, stride_dod, stride_dqm, stride_dqd,
            sm_scale, qk_scale, MODE, HEAD_DIM, BLOCK_D, DOT_PRECISION, BLOCK_M, BLOCK_N, True,
        )
    else:
        _attn_bwd_dq_block(
            Q_head, K_head, V_head, O_head, DO_head, DQ_head, Lse_head, Delta_head,
            start, N_Q, N_KV,
            stride_qm, stride_qd, stride_kn, stride_kd, stride_vn, stride_vd,
            stride_om, stride_od, stride_dom, stride_dod, stride_dqm, stride_dqd,
            sm_scale, qk_scale, MODE, HEAD_DIM, BLOCK_D, DOT_PRECISION, TAIL_C, BLOCK_N, True,
        )


# fmt: on
