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
    attn_chunk_R(...)                   R = 1..4 query rows against one chunk of keys of a paged KV cache

Every function takes whole C-contiguous arrays and flat element offsets (no views: see simd.py).
"""
from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from .ir import (F16, F32, I8, I16, I32, I64, LANES, NEG_INF, VF, VH, VI, call, const, fma, fmax, hmax, hsum, ptr, sfx,
                 splat)

BLOCK = 16                     # keys per KV block: one score vector
CHUNK = 256                    # keys per softmax chunk of lumen.kernels.attention (a multiple of BLOCK): the
                               # unit of split-K for decode. 128 before attn_chunk: a chunk's scores now sit in
                               # a stack buffer, and each chunk boundary costs a merge (attn_chunk's doc)


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


# ---------------------------------------------------------------- attention: R query rows, one chunk of keys

ST = 32                        # floats of a row's softmax state: max, 16 lane sums, padding (two cache lines)
MAX_ROWS = 4                   # query rows per attn_chunk call (the heads of one kv group, 4 at a time)
PAIR = 2                       # key blocks whose scores one pass over d computes: each q[d] broadcast serves both
PV_SLICES = 4                  # 16-dim output slices per pass of the PV loop: each p_j broadcast serves them all


def _make_attn_chunk(R: int):
    """attn_chunk_<R>: the softmax of R consecutive query rows over the keys a .. b-1 of one CHUNK of a paged KV
    cache (c CHUNK <= a < b <= (c + 1) CHUNK), from nothing. The rows share each converted K and V vector.

    q.flat[qo + r*hd : ... + hd] f32           query row r
    k.flat[kb*blk + kg : ... + hd*16] u16 (f16) block blk's keys, transposed: k[d, j] (lanes = keys)
    v.flat[vb*blk + vg : ... + 16*hdv] u16      block blk's values, v[j, d] (lanes = dims)
    bt.flat[bo + j // 16] i64                  the block that holds key j
    st.flat[so + r*ST : ... + 17] f32 (out)    row r's max m, then its 16 lane sums of exp(s - m)
    o.flat[oo + r*hdv : ... + hdv] f32 (out)   row r's unnormalised output sum_j exp(s_j - m) v[j]
    hd % 4 == 0 and hdv % 16 == 0 (lumen.config checks head sizes).

    Per row, in an order that depends on nothing but the row's own keys:
    - scores, one 16-key block at a time: s[j] = scale * (a0 + a1), a0 and a1 the fma sums of q[d] k[d, j] over
      the even and the odd d; keys outside a .. b masked (their bytes may be anything, even NaN);
    - m = the largest score of the chunk;
    - p[j] = exp(s[j] - m) (0 for a masked key); the lane sums add the blocks' p vectors in block order;
    - o = the blocks' sums in block order, each block's sum_j p[j] v[j] in key order by fma from 0 (chains of 16
      keys, not 256: the error against float64 as the online softmax before it had, 3-7e-7 relative).
    The scores go through a stack buffer of R x CHUNK floats. Per pass over d the kernel takes PAIR blocks (each
    broadcast of q[d] feeds PAIR fmas) and R rows (each converted K vector feeds R); the PV loop takes PV_SLICES
    16-dim slices per key (each broadcast of p[j] feeds PV_SLICES fmas, R x PV_SLICES independent chains). R,
    PAIR and PV_SLICES change how much work shares a load, never a row's sums.

    Each pass over d also prefetches one 64-byte line of each of the next pass's key blocks into L1 and one of
    these blocks' values into L2: a sequence's blocks lie anywhere in the pool, and a stream that jumps every 2 KB
    keeps the hardware prefetchers from running ahead.

    Measured, 2-vCPU AMD EPYC (Zen 5), SmolLM2's shapes (3 rows of 64 per kv head), `profiling/attention_rows.py`:
    - this kernel alone, 256 keys in L1, one thread: 1.1 us, 169-191 GFLOP/s, 65-73% of the core's FMA roof (261);
    - a layer's call for 8 decode tokens x 192 keys, in cache, one thread: 50.1 us with the kernel before it (one
      16-key block per call: the running max, the lane sums and the output rescaled per block; PV one 16-dim
      slice at a time, R chains of dependent fmas), 44.7 with PV over 4 slices, 38.3 with this kernel (chunks of
      128 keys, the helpers of lumen.kernels.attention inlined), 25.0 with chunks of 256 keys (no merge below
      257 keys);
    - 30 layers' caches in turn, 16 tokens x 192 keys (71 MB), two threads: 6.5-9.4 ms before, 2.9-3.8 now;
      with the blocks scattered, 5.5 ms without the prefetches and 2.7 with them (26 GB/s of the 44 measured)."""
    def codegen(context, builder, sig, args):
        (o_, oo_, st_, so_, q_, qo_, k_, v_, bt_, bo_, kb_, kg_, vb_, vg_, hd_, hdv_, scale_, a_, b_) = args
        ta = sig.args
        i64 = lambda n: ir.Constant(I64, n)  # noqa: E731
        op = ptr(context, builder, ta[0], o_, F32, oo_)
        sp = ptr(context, builder, ta[2], st_, F32, so_)
        qp = ptr(context, builder, ta[4], q_, F32, qo_)
        kp = ptr(context, builder, ta[6], k_, I16)
        vp = ptr(context, builder, ta[7], v_, I16)
        btp = ptr(context, builder, ta[8], bt_, I64, bo_)
        qrow = [builder.gep(qp, [builder.mul(i64(r), hd_)]) for r in range(R)]
        orow = [builder.gep(op, [builder.mul(i64(r), hdv_)]) for r in range(R)]
        srow = [builder.gep(sp, [i64(r * ST)]) for r in range(R)]
        nv = CHUNK // LANES
        sbuf = cgutils.alloca_once(builder, VF, size=R * nv)                  # (R, CHUNK) scores, then p
        sflat = builder.bitcast(sbuf, F32.as_pointer())
        b16 = builder.sdiv(a_, i64(BLOCK))                                     # the chunk's first block
        j0 = builder.mul(b16, i64(BLOCK))
        nblk = builder.sdiv(builder.add(builder.sub(b_, j0), i64(BLOCK - 1)), i64(BLOCK))
        lane = ir.Constant(VI, list(range(LANES)))
        lo = splat(builder, builder.trunc(a_, I32), VI)
        hi = splat(builder, builder.trunc(b_, I32), VI)
        zero = ir.Constant(VF, None)

        def block(bi):                         # the pool block of the chunk's block bi
            return builder.load(builder.gep(btp, [builder.add(b16, bi)]))

        def valid(bi):                         # lanes of block bi whose keys lie in a .. b-1
            key = builder.add(splat(builder, builder.trunc(builder.add(j0, builder.mul(bi, i64(BLOCK))), I32), VI),
                              lane)
            return builder.and_(builder.icmp_signed(">=", key, lo), builder.icmp_signed("<", key, hi))

        def load_h(base, off):                 # 16 halves at base + off -> <16 x float>
            hv = builder.load(builder.bitcast(builder.gep(base, [off]), VH.as_pointer()), align=2)
            return builder.fpext(hv, VF)

        def svec(r, bi):                       # row r's scores of block bi in the buffer
            return builder.gep(sbuf, [builder.add(i64(r * nv), bi)])

        sc = splat(builder, scale_)

        pfn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(
            ir.VoidType(), [I8.as_pointer(), I32, I32, I32]), "llvm.prefetch.p0")
        last = builder.sub(nblk, i64(1))

        def prefetch(base, byte_off, level):   # one line at base + byte_off (bytes) into L1 (3) or L2 (2)
            p = builder.gep(builder.bitcast(base, I8.as_pointer()), [byte_off])
            builder.call(pfn, [p, ir.Constant(I32, 0), ir.Constant(I32, level), ir.Constant(I32, 1)])

        vline = builder.sdiv(builder.mul(hdv_, i64(64)), hd_)   # V bytes per pass over d: its hd/2 passes cover
                                                                # a block's 32 hdv bytes

        def scores(bi0, B):                    # blocks bi0 .. bi0 + B - 1, every row
            bis = [builder.add(bi0, i64(u)) for u in range(B)]
            kbs = [builder.gep(kp, [builder.add(builder.mul(block(bi), kb_), kg_)]) for bi in bis]
            vbs = [builder.gep(vp, [builder.add(builder.mul(block(bi), vb_), vg_)]) for bi in bis]
            nxt = [builder.add(bi, i64(B)) for bi in bis]                      # the next pass's blocks (the last
            nxt = [builder.select(builder.icmp_signed(">", n, last), last, n) for n in nxt]  # one again at the end)
            kns = [builder.gep(kp, [builder.add(builder.mul(block(bi), kb_), kg_)]) for bi in nxt]
            acc = [[[cgutils.alloca_once_value(builder, zero) for _ in range(2)] for _ in range(B)] for _ in range(R)]
            with cgutils.for_range(builder, builder.sdiv(hd_, i64(2))) as loop:
                # one 64-byte line of each block per pass: the next pass's keys into L1, these blocks' values
                # (read after the chunk's softmax) into L2, so that scattered blocks do not wait on memory
                for u in range(B):
                    prefetch(kns[u], builder.mul(loop.index, i64(64)), 3)
                    prefetch(vbs[u], builder.mul(loop.index, vline), 2)
                for par in range(2):
                    d = builder.add(builder.mul(loop.index, i64(2)), i64(par))
                    kv = [load_h(kbs[u], builder.mul(d, i64(BLOCK))) for u in range(B)]
                    for r in range(R):
                        qd = splat(builder, builder.load(builder.gep(qrow[r], [d])))
                        for u in range(B):
                            builder.store(fma(builder, qd, kv[u], builder.load(acc[r][u][par])), acc[r][u][par])
            for u in range(B):
                ok = valid(bis[u])
                for r in range(R):
                    s = builder.fmul(builder.fadd(builder.load(acc[r][u][0]), builder.load(acc[r][u][1])), sc)
                    builder.store(builder.select(ok, s, const(NEG_INF, VF)), svec(r, bis[u]))

        npair = builder.sdiv(nblk, i64(PAIR))
        with cgutils.for_range(builder, npair) as loop:
            scores(builder.mul(loop.index, i64(PAIR)), PAIR)
        with cgutils.for_range_slice(builder, builder.mul(npair, i64(PAIR)), nblk, i64(1)) as (bi, _):
            scores(bi, 1)

        # softmax per row: the chunk's max, p = exp(s - m), lane sums in block order
        for r in range(R):
            mv = cgutils.alloca_once_value(builder, const(NEG_INF, VF))
            with cgutils.for_range(builder, nblk) as loop:
                builder.store(fmax(builder, builder.load(svec(r, loop.index)), builder.load(mv)), mv)
            m = splat(builder, hmax(builder, builder.load(mv)))
            ls = cgutils.alloca_once_value(builder, zero)
            with cgutils.for_range(builder, nblk) as loop:
                p = builder.select(valid(loop.index), _exp(builder, builder.fsub(builder.load(svec(r, loop.index)), m)),
                                   zero)
                builder.store(p, svec(r, loop.index))
                builder.store(builder.fadd(builder.load(ls), p), ls)
            builder.store(builder.extract_element(m, ir.Constant(I32, 0)), srow[r])
            builder.store(builder.load(ls), builder.bitcast(builder.gep(srow[r], [i64(1)]), VF.as_pointer()), align=4)

        # o = sum_j p_j v_j, key by key, PV_SLICES 16-dim slices per pass (then the slices left one at a time)
        def pv(sl0, U):
            offs = [builder.mul(builder.add(sl0, i64(u)), i64(LANES)) for u in range(U)]
            optr = [[builder.bitcast(builder.gep(orow[r], [offs[u]]), VF.as_pointer()) for u in range(U)]
                    for r in range(R)]
            for r in range(R):
                for u in range(U):
                    builder.store(zero, optr[r][u], align=4)
            acc = [[cgutils.alloca_once(builder, VF) for _ in range(U)] for _ in range(R)]
            with cgutils.for_range(builder, nblk) as bl:
                bi = bl.index
                for r in range(R):
                    for u in range(U):
                        builder.store(zero, acc[r][u])
                vbase = builder.gep(vp, [builder.add(builder.mul(block(bi), vb_), vg_)])
                start = builder.add(j0, builder.mul(bi, i64(BLOCK)))
                jl = builder.sub(builder.select(builder.icmp_signed(">", a_, start), a_, start), start)
                end = builder.add(start, i64(BLOCK))
                jh = builder.sub(builder.select(builder.icmp_signed("<", b_, end), b_, end), start)
                with cgutils.for_range_slice(builder, jl, jh, i64(1)) as (jj, _):
                    row = builder.mul(jj, hdv_)
                    vv = [load_h(vbase, builder.add(row, offs[u])) for u in range(U)]
                    for r in range(R):
                        pidx = builder.add(builder.mul(builder.add(i64(r * nv), bi), i64(LANES)), jj)
                        pj = splat(builder, builder.load(builder.gep(sflat, [pidx])))
                        for u in range(U):
                            builder.store(fma(builder, pj, vv[u], builder.load(acc[r][u])), acc[r][u])
                for r in range(R):                 # the block's sum into the output: chains of 16 keys
                    for u in range(U):
                        o_ = builder.load(optr[r][u], align=4)
                        builder.store(builder.fadd(o_, builder.load(acc[r][u])), optr[r][u], align=4)

        n_sl = builder.sdiv(hdv_, i64(LANES))
        n_wide = builder.sdiv(n_sl, i64(PV_SLICES))
        with cgutils.for_range(builder, n_wide) as dl:
            pv(builder.mul(dl.index, i64(PV_SLICES)), PV_SLICES)
        with cgutils.for_range_slice(builder, builder.mul(n_wide, i64(PV_SLICES)), n_sl, i64(1)) as (dl, _):
            pv(dl, 1)
        return context.get_dummy_value()

    def typer(typingctx, o, oo, st, so, q, qo, k, v, bt, bo, kb, kg, vb, vg, hd, hdv, scale, a, b):
        ip = types.intp
        return types.void(o, ip, st, ip, q, ip, k, v, bt, ip, ip, ip, ip, ip, ip, ip, types.float32, ip, ip), codegen

    typer.__name__ = f"attn_chunk_{R}"
    return intrinsic(typer)


attn_chunk_1, attn_chunk_2, attn_chunk_3, attn_chunk_4 = (_make_attn_chunk(R) for R in range(1, MAX_ROWS + 1))
