"""Float kernels whose rounding is written down, not left to the optimizer: LLVM IR intrinsics.

Why: with fastmath, LLVM may reassociate a sum or fuse a multiply and an add differently in every place a
function is compiled, and Numba compiles each callee twice: once on its own and once again inside every caller
that links it. Which of the two copies a call reaches depends on which libraries the JIT engine had loaded
first, so the same forward pass gave different bits after a fresh compile than after a load from Numba's cache
(measured: SmolLM2 logits up to 3.3 apart over 300 tokens). The cure is to give no optimizer a choice:
every float kernel in Lumen is compiled without fastmath, and where a reduction must be vectorized to be fast,
its order is spelled out here, in IR with explicit `llvm.fma`, lanes and accumulators. The same source then
gives the same bits in every caller, on every thread count, from a fresh compile or from the cache.

Contents:
    exp_f32(x)                          scalar exp: range reduction and a degree-6 polynomial, all fma
    sumsq(x, xo, n)                     sum of x[xo + i]^2: 4 accumulators of 16 lanes, fixed final tree
    f16_bits(x) / f16_value(h)          f32 <-> IEEE half bits (uint16), round to nearest even
    attn_block_R(...)                   R = 1..4 query rows against one 16-key block of a paged KV cache

Every function takes whole C-contiguous arrays and flat element offsets (no views: see simd.py).
"""
from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from .ir import F16, F32, I16, I32, I64, LANES, NEG_INF, VF, VH, VI, call, const, fma, fmax, hmax, hsum, ptr, sfx, splat

BLOCK = 16                     # keys per KV block: one score vector
CHUNK = 128                    # keys per softmax chunk of lumen.kernels.attention (a multiple of BLOCK): the
                               # unit of split-K for decode


def _exp(builder, x):
    """exp(x) for f32 or <16 x f32>: x clamped to [-87, 88], x = k ln2 + r, exp(r) by a degree-6 Taylor
    polynomial in Horner form with fma, times 2^k through the exponent bits. Relative error < 2e-7.
    NaN stays NaN; -inf gives exp(-87) ~ 1.6e-38 (callers that need an exact 0 select it)."""
    ty = x.type
    ity = ir.VectorType(I32, ty.count) if isinstance(ty, ir.VectorType) else I32
    c = lambda v: const(v, ty)  # noqa: E731
    x = builder.select(builder.fcmp_ordered("<", x, c(-87.0)), c(-87.0), x)
    x = builder.select(builder.fcmp_ordered(">", x, c(88.0)), c(88.0), x)
    k = call(builder, f"llvm.floor.{sfx(ty)}", ty, [fma(builder, x, c(1.44269504), c(0.5))])
    k = builder.select(builder.fcmp_unordered("uno", k, k), c(0.0), k)      # NaN: keep fptosi defined
    r = fma(builder, builder.fneg(k), c(0.693145752), x)                    # ln2 split in a high part
    r = fma(builder, builder.fneg(k), c(1.42860677e-06), r)                 # and a low part
    p = c(1.0 / 720.0)
    for coef in (1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0, 0.5, 1.0, 1.0):
        p = fma(builder, p, r, c(coef))
    ki = builder.fptosi(k, ity)
    scale = builder.bitcast(builder.shl(builder.add(ki, const(127, ity)), const(23, ity)), ty)
    return builder.fmul(p, scale)


# ---------------------------------------------------------------- scalar helpers

@intrinsic
def exp_f32(typingctx, x):
    """exp(x) for a float32 x, the same function as the vector exp of the attention blocks (see _exp)."""
    def codegen(context, builder, sig, args):
        return _exp(builder, args[0])
    return types.float32(types.float32), codegen


@intrinsic
def fma_f32(typingctx, a, b, c):
    """a * b + c with one rounding (float32)."""
    def codegen(context, builder, sig, args):
        return fma(builder, *args)
    return types.float32(types.float32, types.float32, types.float32), codegen


@intrinsic
def f16_bits(typingctx, x):
    """The IEEE half nearest to the float32 x (ties to even), as its uint16 bits."""
    def codegen(context, builder, sig, args):
        return builder.bitcast(builder.fptrunc(args[0], F16), I16)
    return types.uint16(types.float32), codegen


@intrinsic
def f16_value(typingctx, h):
    """The float32 value of the IEEE half whose bits are h (uint16); exact."""
    def codegen(context, builder, sig, args):
        return builder.fpext(builder.bitcast(args[0], F16), F32)
    return types.float32(types.uint16), codegen


@intrinsic
def sumsq(typingctx, x, xo, n):
    """sum of x.flat[xo + i]^2 for i < n (x float32, C-contiguous). Vectors of 16 lanes go to accumulator
    (i // 16) % 4 by fma, then (a0 + a1) + (a2 + a3), the fixed halving tree over the lanes, then the n % 64
    elements left, in order, by fma. The order depends on n only."""
    def codegen(context, builder, sig, args):
        xa, xo_, n_ = args
        xp = ptr(context, builder, sig.args[0], xa, F32, xo_)
        zero = ir.Constant(VF, None)
        accs = [cgutils.alloca_once_value(builder, zero) for _ in range(4)]
        nq = builder.sdiv(n_, ir.Constant(I64, 4 * LANES))
        with cgutils.for_range(builder, nq) as loop:
            base = builder.mul(loop.index, ir.Constant(I64, 4 * LANES))
            for u in range(4):
                p = builder.gep(xp, [builder.add(base, ir.Constant(I64, u * LANES))])
                v = builder.load(builder.bitcast(p, VF.as_pointer()), align=4)
                builder.store(fma(builder, v, v, builder.load(accs[u])), accs[u])
        a = [builder.load(s) for s in accs]
        total = cgutils.alloca_once_value(builder, hsum(builder, builder.fadd(builder.fadd(a[0], a[1]),
                                                                              builder.fadd(a[2], a[3]))))
        start = builder.mul(nq, ir.Constant(I64, 4 * LANES))
        with cgutils.for_range_slice(builder, start, n_, ir.Constant(I64, 1)) as (i, _):
            v = builder.load(builder.gep(xp, [i]))
            builder.store(fma(builder, v, v, builder.load(total)), total)
        return builder.load(total)
    return types.float32(x, types.intp, types.intp), codegen


# ---------------------------------------------------------------- attention: R query rows, one KV block

ST = 32                        # floats of a row's softmax state: max, 16 lane sums, padding (two cache lines)
MAX_ROWS = 4                   # query rows per attn_block call (the heads of one kv group, 4 at a time)


def _make_attn_block(R: int):
    """attn_block_<R>: continue the online softmax of R consecutive query rows over the keys jlo .. jhi-1
    (0 <= jlo < jhi <= 16) of one KV block. The rows share each converted K and V vector.

    q.flat[qo + r*hd : ... + hd] f32      query row r
    k.flat[ko : ko + hd*16] u16 (f16)     the block's keys, transposed: k[d, j] (lanes = keys)
    v.flat[vo : vo + 16*hdv] u16 (f16)    the block's values, v[j, d] (lanes = dims)
    st.flat[so + r*ST : ... + 17] f32     row r's state: running max m, then 16 lane sums of exp(s - m)
    o.flat[oo + r*hdv : ... + hdv] f32    row r's unnormalised output
    hd % 4 == 0 and hdv % 16 == 0 (lumen.config checks head sizes).

    Per row, in an order that depends on nothing but the row's own keys: s[j] = scale * sum_d q[d] k[d, j] with 4
    accumulators (d % 4) combined as (a0 + a1) + (a2 + a3); keys outside jlo..jhi masked (their bytes may be
    anything, even NaN); m' = max(m, max_j s[j]); alpha = exp(m - m') (0 when m = -inf, exactly 1 when the max
    did not grow); lane sums = lane sums * alpha + exp(s - m'); o = o * alpha, then o += exp(s_j - m') v[j]
    for j in key order, by fma. The row count R changes how much work shares a load, never a row's sums."""
    def codegen(context, builder, sig, args):
        (o_, oo_, st_, so_, q_, qo_, k_, ko_, v_, vo_, hd_, hdv_, scale_, jlo_, jhi_) = args
        ta = sig.args
        op = ptr(context, builder, ta[0], o_, F32, oo_)
        sp = ptr(context, builder, ta[2], st_, F32, so_)
        qp = ptr(context, builder, ta[4], q_, F32, qo_)
        kp = ptr(context, builder, ta[6], k_, I16, ko_)
        vp = ptr(context, builder, ta[8], v_, I16, vo_)
        i64 = lambda n: ir.Constant(I64, n)  # noqa: E731
        qrow = [builder.gep(qp, [builder.mul(i64(r), hd_)]) for r in range(R)]
        orow = [builder.gep(op, [builder.mul(i64(r), hdv_)]) for r in range(R)]
        srow = [builder.gep(sp, [i64(r * ST)]) for r in range(R)]

        def load_h(ptr, off):                  # 16 halves at ptr + off -> <16 x float>
            hv = builder.load(builder.bitcast(builder.gep(ptr, [off]), VH.as_pointer()), align=2)
            return builder.fpext(hv, VF)

        # scores: per row 4 accumulators over d, lanes = keys; each K vector converted once for all rows
        accs = [[cgutils.alloca_once_value(builder, ir.Constant(VF, None)) for _ in range(4)] for _ in range(R)]
        with cgutils.for_range(builder, builder.sdiv(hd_, i64(4))) as loop:
            d0 = builder.mul(loop.index, i64(4))
            for u in range(4):
                d = builder.add(d0, i64(u))
                kv = load_h(kp, builder.mul(d, i64(BLOCK)))
                for r in range(R):
                    qd = splat(builder, builder.load(builder.gep(qrow[r], [d])))
                    builder.store(fma(builder, qd, kv, builder.load(accs[r][u])), accs[r][u])
        lane = ir.Constant(VI, list(range(LANES)))
        lo = splat(builder, builder.trunc(jlo_, I32), VI)
        hi = splat(builder, builder.trunc(jhi_, I32), VI)
        valid = builder.and_(builder.icmp_signed(">=", lane, lo), builder.icmp_signed("<", lane, hi))
        sc = splat(builder, scale_)
        neg_inf = ir.Constant(F32, NEG_INF)
        pbuf = cgutils.alloca_once(builder, VF, size=R)          # the rows' probabilities, for the PV loop
        alphas = []
        for r in range(R):
            a = [builder.load(x) for x in accs[r]]
            s = builder.fmul(builder.fadd(builder.fadd(a[0], a[1]), builder.fadd(a[2], a[3])), sc)
            s = builder.select(valid, s, const(NEG_INF, VF))
            m_old = builder.load(srow[r])
            m_new = fmax(builder, hmax(builder, s), m_old)
            grew = builder.fcmp_ordered(">", m_new, m_old)
            alpha = builder.select(grew, builder.select(builder.fcmp_ordered("==", m_old, neg_inf),
                                                        ir.Constant(F32, 0.0),
                                                        _exp(builder, builder.fsub(m_old, m_new))),
                                   ir.Constant(F32, 1.0))
            m = builder.select(grew, m_new, m_old)
            builder.store(m, srow[r])
            p = builder.select(valid, _exp(builder, builder.fsub(s, splat(builder, m))), ir.Constant(VF, None))
            lsp = builder.bitcast(builder.gep(srow[r], [i64(1)]), VF.as_pointer())
            builder.store(builder.fadd(builder.fmul(builder.load(lsp, align=4), splat(builder, alpha)), p), lsp,
                          align=4)
            builder.store(p, builder.gep(pbuf, [i64(r)]))
            alphas.append(splat(builder, alpha))
        pf = builder.bitcast(pbuf, F32.as_pointer())                # (R, 16) floats

        # o = o * alpha + sum_j p_j v_j, key by key; each V vector converted once for all rows
        with cgutils.for_range(builder, builder.sdiv(hdv_, i64(LANES))) as dl:
            off = builder.mul(dl.index, i64(LANES))
            ptrs = [builder.bitcast(builder.gep(orow[r], [off]), VF.as_pointer()) for r in range(R)]
            acc = [cgutils.alloca_once_value(builder, builder.fmul(builder.load(ptrs[r], align=4), alphas[r]))
                   for r in range(R)]
            with cgutils.for_range_slice(builder, jlo_, jhi_, i64(1)) as (j, _):
                vv = load_h(vp, builder.add(builder.mul(j, hdv_), off))
                for r in range(R):
                    pj = splat(builder, builder.load(builder.gep(pf, [builder.add(i64(r * LANES), j)])))
                    builder.store(fma(builder, pj, vv, builder.load(acc[r])), acc[r])
            for r in range(R):
                builder.store(builder.load(acc[r]), ptrs[r], align=4)
        return context.get_dummy_value()

    def typer(typingctx, o, oo, st, so, q, qo, k, ko, v, vo, hd, hdv, scale, jlo, jhi):
        ip = types.intp
        return types.void(o, ip, st, ip, q, ip, k, ip, v, ip, ip, ip, types.float32, ip, ip), codegen

    typer.__name__ = f"attn_block_{R}"
    return intrinsic(typer)


attn_block_1, attn_block_2, attn_block_3, attn_block_4 = (_make_attn_block(R) for R in range(1, MAX_ROWS + 1))
