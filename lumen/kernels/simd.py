"""The quantized tile kernels, written as LLVM vector IR: one 64-row weight tile times 1 or NR activation rows.

LLVM never emits vpdpbusd from Numba loops (shared/KERNELS.md), and the int16-lane loops it does emit top out
at about 25 G MAC/s per core here. vpdpbusd multiplies 4 unsigned bytes by 4 signed bytes and adds the 4 products
to an int32 lane: 64 products per 512-bit instruction. These intrinsics emit it directly when the CPU has
AVX512-VNNI (llvm.x86.avx512.vpdpbusd.512), and otherwise the same arithmetic as portable vector IR (widen,
multiply, add) that any LLVM target compiles; the integers are the same either way.

The weights are read in the compact layout of lumen.kernels.layout (nibbles plus bit planes, f16 / u8 / i8 scales)
and unpacked in registers: per group of 32 columns and 16 rows, 8 vectors of 4 unsigned bytes per lane
(u = nibble | plane bits << 4). Per group and half h (16 columns), sum (u - z) x = sum u x - z sum x is an exact
integer (|.| < 2^21); z sum x comes from the activations' integer half sums (xi). The float epilogue is the one
llama.cpp's x86 dot products apply per block, every operation rounded on its own (never fused into an FMA):
    D   f + (d_w * d_x) * sum
    DM  f + ((d_w * d_x) * sum + o * (d_x sum x)),  o = m + z d_w
    K   as DM with d_w = d * sc, o = z d_w - dmin * min  (d, dmin f16; sc, min 6-bit)
    K6  f + d_x * (s0 * sum0 + s1 * sum1),  s_h = d * sc_h
where d_x sum x = xs[0] + xs[1] (the activations' scaled half sums). The scale arithmetic is the one the previous
f32 layout did once at load time, in the same order, so the outputs are the same bits.

Two loop orders, the same operations per row and group in the same order (so the same bits):
- 1 row (decode): groups outer, the 64 row sums in 4 registers, the weights streamed in memory order;
- NR = 4 rows (batched): half a tile (NVP = 2 vectors of 16 rows) per call, groups outer, the 4 x 2 row sums in
  8 registers; each weight vector is loaded and unpacked once and used for the 4 activation rows, whose bytes are
  broadcast into vpdpbusd. The half tile reads the weights in memory order. Q6_K keeps one vector at a time,
  groups inner (its unpack holds more registers).
  The next tile is prefetched into L2 while a tile is computed, each pass taking its share, spread over its
  groups, so the DRAM stream overlaps the compute (us per matrix, same bench as below, SmolLM2 gate+up, N = 4 / 8 /
  16 / 64 / 256: the whole next tile prefetched at once before the passes 38.1 / 42.6 / 83.6 / 214 / 739, spread
  over the passes 21.5 / 33.2 / 61.2 / 198 / 746; spread over the first pass only 24.1 / 37.6 / 68.9 / 229 / 851).
  The shape was chosen by measurement (AMD EPYC Zen 5, 1 thread, every layer's matrices of a kind so the
  weights stream from DRAM, interleaved medians of 7, load 1.3-1.9 from neighbours; the int8 roof on this host
  is 1092 GOP/s per core, lumen.profile --machine): us per matrix at N = 4 / 8 / 16 / 64
    SmolLM2 gate+up Q4_1 1536x576, 33 MB:  16 rows x 4, groups inner (before)  36.7 / 53.8 / 79.0 / 246
                                           64 rows x 4, groups outer           26.7 / 44.2 / 71.7 / 241
                                           32 rows x 4, groups outer  (this)   25.9 / 38.4 / 57.4 / 194
                                           32 rows x 8 / 64 x 2 / 16 x 4      44.9 / 44.6 / 56.6 at N = 8
    Gemma gate+up Q5_0 2048x640:     before 64.9 / 74.1 / 104.5 / 315, this 42.8 / 57.0 / 93.0 / 320
    Gemma attn_output Q4_K 640x1024: before 10.7 / 20.7 / 41.8 / 163,  this 10.3 / 18.8 / 36.2 / 142
    Gemma head Q8_0 262144x640:      before 9749 / 11176 / 16431 (N = 4 / 8 / 16), this 7791 / 10044 / 13273
    Gemma ffn_down Q6_K 640x2048:    16 x 4 groups inner 23.8 / 46.5 / 89.2 / 351; 32 x 4 groups outer
                                     36.6 / 66.4 / 129 / 494 (so Q6_K keeps groups inner)
  End to end at 2 threads the gain did not show on this shared host: lumen.bench batch -npp 128 -ntg 64 -npl
  4,8,16 -r 1, SmolLM2, the previous kernels and these alternated 3 times (load 1.5-1.7), median gen t/s 836 /
  1046 / 1265 before, 816 / 1025 / 1268 after (per-run spread 5-10%); the engine's step holds attention, the
  per-row ops and the glue besides the matmuls, and two threads share one memory stream.
  Splitting a row's 8 dot products over two integer accumulators (shorter dependency chains) was slower
  (N = 64: 246 against 197 us): it needs 8 more registers.
"""
from __future__ import annotations

import os

import llvmlite.binding as llvm
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from .ir import (F16, F32, I8, I32, LANES, V8I32, VB8, VF, VH, VI, add, call, i64, ivec, mul, ptr, splat, sub,
                 vload)
from .layout import GROUP_BYTES, NIB_BYTES, Q5, Q6, Q8, R, SC_D, SC_DM, SC_K, SC_K6

_features = llvm.get_host_cpu_features()
# LUMEN_NO_VNNI=1 compiles the portable IR even on a VNNI CPU (for tests; lumen/__init__.py gives that build its
# own compile cache, because Numba's cache key knows the CPU but not this switch).
VNNI = (bool(_features.get("avx512vnni", False) and _features.get("avx512vl", False))
        and os.environ.get("LUMEN_NO_VNNI", "0") in ("", "0"))

ROWS = R                       # rows of a tile; LANES (lumen.kernels.ir) = 16 rows per vector (i32 lanes)


# ---- 256-bit helpers (lumen.machine's int8 dot measures with these)

def _bcast32(builder, xp, quad):
    """The 4 bytes x[4 quad .. 4 quad + 3] as one int32, broadcast to 8 lanes."""
    p = builder.bitcast(builder.gep(xp, [ir.Constant(I32, 4 * quad)]), I32.as_pointer())
    s = builder.load(p, align=1)
    v = builder.insert_element(ir.Constant(V8I32, ir.Undefined), s, ir.Constant(I32, 0))
    return builder.shuffle_vector(v, ir.Constant(V8I32, ir.Undefined), ir.Constant(V8I32, [0] * 8))


def _dpbusd(builder, acc, u, x):
    """acc + per lane: sum of 4 u8 bytes of u times the 4 i8 bytes of x (8 or 16 x i32 vectors)."""
    vt = acc.type
    n = vt.count
    if VNNI:
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vt, [vt] * 3),
                                            f"llvm.x86.avx512.vpdpbusd.{32 * n}")
        return builder.call(fn, [acc, u, x])
    wide = ir.VectorType(I32, 4 * n)
    ub = builder.zext(builder.bitcast(u, ir.VectorType(I8, 4 * n)), wide)
    xb = builder.sext(builder.bitcast(x, ir.VectorType(I8, 4 * n)), wide)
    p = builder.mul(ub, xb)
    undef = ir.Constant(wide, ir.Undefined)
    for b in range(4):
        acc = builder.add(acc, builder.shuffle_vector(p, undef, ir.Constant(ir.VectorType(I32, n),
                                                                              list(range(b, 4 * n, 4)))))
    return acc


# The intrinsics take whole C-contiguous arrays and flat element offsets into them, not views: a view made in
# a hot loop costs an atomic increment and decrement of the parent's reference count, and when two threads do
# that on one array the count's cache line moves between the cores on every call.

def _unpack(builder, fam, wg):
    """The 8 quads (4 unsigned bytes per lane, columns 4k..4k+3) of 16 rows of one group: wg (i8*) points at the
    group's bytes plus the rows' offset in a 256-byte run."""
    if fam == Q8:
        return [vload(builder, wg, k * ROWS * 4, VI) for k in range(8)]
    m0f = ivec(0x0F0F0F0F)
    ws = [vload(builder, wg, k * ROWS * 4, VI) for k in range(4)]
    u = [builder.and_(w, m0f) for w in ws] + [builder.and_(builder.lshr(w, ivec(4)), m0f) for w in ws]
    if fam == Q5:                        # byte b bit k of the plane word -> bit 4 of quad k's byte b
        hb = vload(builder, wg, NIB_BYTES, VI)
        for k in range(8):
            sh = builder.shl(hb, ivec(4 - k)) if k < 4 else builder.lshr(hb, ivec(k - 4)) if k > 4 else hb
            u[k] = builder.or_(u[k], builder.and_(sh, ivec(0x10101010)))
    elif fam == Q6:                      # word j byte b bits 2m, 2m+1 -> bits 4, 5 of quad 4j+m's byte b
        for j in range(2):
            hb = vload(builder, wg, NIB_BYTES + j * ROWS * 4, VI)
            for m in range(4):
                sh = builder.shl(hb, ivec(4 - 2 * m)) if m < 2 else hb if m == 2 else builder.lshr(hb, ivec(2))
                u[4 * j + m] = builder.or_(u[4 * j + m], builder.and_(sh, ivec(0x30303030)))
    return u


def _scales(builder, sc, z, sp, g, G, v1, v2):
    """The scale vectors of 16 rows in group g: (d_w, o) or (s0, s1). sp (i8*): the tile's scale record; v1, v2:
    the rows' offset in bytes of a u8 / f16 row vector."""
    if sc == SC_D:
        sg = builder.gep(sp, [builder.add(builder.mul(g, i64(2 * ROWS)), v2)])
        return builder.fpext(vload(builder, sg, 0, VH), VF), None
    zf = ir.Constant(VF, [float(z)] * LANES)
    if sc == SC_DM:
        sg = builder.gep(sp, [builder.add(builder.mul(g, i64(4 * ROWS)), v2)])
        d = builder.fpext(vload(builder, sg, 0, VH), VF)
        m = builder.fpext(vload(builder, sg, 2 * ROWS, VH), VF)
        return d, add(builder, m, mul(builder, zf, d))
    sg = builder.gep(sp, [builder.add(builder.mul(g, i64(2 * ROWS)), v1)])
    blk = builder.add(builder.mul(G, i64(2 * ROWS)),
                      builder.mul(builder.udiv(g, i64(8)), i64((4 if sc == SC_K else 2) * ROWS)))
    sb = builder.gep(sp, [builder.add(blk, v2)])
    d = builder.fpext(vload(builder, sb, 0, VH), VF)
    if sc == SC_K:
        scale = builder.uitofp(vload(builder, sg, 0, VB8), VF)
        mn = builder.uitofp(vload(builder, sg, ROWS, VB8), VF)
        dmin = builder.fpext(vload(builder, sb, 2 * ROWS, VH), VF)
        dw = mul(builder, d, scale)
        return dw, sub(builder, mul(builder, zf, dw), mul(builder, dmin, mn))
    assert sc == SC_K6
    return (mul(builder, d, builder.sitofp(vload(builder, sg, 0, VB8), VF)),
            mul(builder, d, builder.sitofp(vload(builder, sg, ROWS, VB8), VF)))


def _row_group(builder, sc, z, f, u, scl, xg, xig, dg, sxg):
    """f (16 row sums) + group g's contribution for one activation row: xg (i8*) its 32 bytes, xig (i32*) its two
    integer half sums, dg (f32*) its scale, sxg (f32*) its two scaled half sums. The integer sums start from
    -z * sum x (so no subtraction after), one per half for K6, one for the whole group otherwise."""
    zsh = ir.Constant(I32, z.bit_length() - 1)          # z is a power of two
    c0 = builder.shl(builder.load(xig), zsh)
    c1 = builder.shl(builder.load(builder.gep(xig, [ir.Constant(I32, 1)])), zsh)
    if sc == SC_K6:
        a = [splat(builder, builder.neg(c0), VI), splat(builder, builder.neg(c1), VI)]
    else:
        a = [splat(builder, builder.neg(builder.add(c0, c1)), VI)] * 2
    for k in range(8):
        p = builder.bitcast(builder.gep(xg, [ir.Constant(I32, 4 * k)]), I32.as_pointer())
        j = k // 4 if sc == SC_K6 else 0
        a[j] = _dpbusd(builder, a[j], u[k], splat(builder, builder.load(p, align=1), VI))
    sd = splat(builder, builder.load(dg), VF)
    if sc == SC_K6:
        s0, s1 = scl
        a0, a1 = builder.sitofp(a[0], VF), builder.sitofp(a[1], VF)
        return add(builder, f, mul(builder, sd, add(builder, mul(builder, s0, a0), mul(builder, s1, a1))))
    dw, o = scl
    t = mul(builder, mul(builder, dw, sd), builder.sitofp(a[0], VF))
    if sc in (SC_DM, SC_K):
        sx = builder.fadd(builder.load(sxg), builder.load(builder.gep(sxg, [ir.Constant(I32, 1)])))
        t = add(builder, t, mul(builder, o, splat(builder, sx, VF)))
    return add(builder, f, t)


def _make_tile(fam: int, sc: int, z: int, nr: int):
    NV = ROWS // LANES
    gbytes = GROUP_BYTES[fam]
    groups_outer = fam != Q6      # the batched loop order (module doc: measured per family)

    def codegen(context, builder, sig, args):
        (out, oo, ostride, q, qo, s, so, xq, xo, xd, xdo, xs, xso, xi, xio, G) = args[:16]
        ta = sig.args
        fp = ptr(context, builder, ta[0], out, F32, oo)
        qp = ptr(context, builder, ta[3], q, I8, qo)
        sp = ptr(context, builder, ta[5], s, I8, so)
        xp = ptr(context, builder, ta[7], xq, I8, xo)
        dp = ptr(context, builder, ta[9], xd, F32, xdo)
        sxp = ptr(context, builder, ta[11], xs, F32, xso)
        xip = ptr(context, builder, ta[13], xi, I32, xio)

        def row(g, i):
            """Pointers to activation row i's bytes, half sums, scale and scaled half sums of group g."""
            gi = builder.add(g, builder.mul(G, i64(i)))
            j2 = builder.mul(gi, i64(2))
            return (builder.gep(xp, [builder.mul(gi, i64(32))]), builder.gep(xip, [j2]), builder.gep(dp, [gi]),
                    builder.gep(sxp, [j2]))

        if nr == 1:      # groups outer: the 64 row sums in registers, the weights read in memory order
            f_slots = [cgutils.alloca_once_value(builder, ir.Constant(VF, None)) for _ in range(NV)]
            with cgutils.for_range(builder, G) as loop:
                g = loop.index
                wgrp = builder.gep(qp, [builder.mul(g, i64(gbytes))])
                ptrs = row(g, 0)
                for vec in range(NV):
                    u = _unpack(builder, fam, builder.gep(wgrp, [i64(vec * LANES * 4)]))
                    scl = _scales(builder, sc, z, sp, g, G, i64(vec * LANES), i64(vec * LANES * 2))
                    builder.store(_row_group(builder, sc, z, builder.load(f_slots[vec]), u, scl, *ptrs), f_slots[vec])
            for vec in range(NV):
                p = builder.bitcast(builder.gep(fp, [i64(vec * LANES)]), VF.as_pointer())
                builder.store(builder.load(f_slots[vec]), p, align=4)
            return context.get_dummy_value()

        # nr rows x the NVP weight vectors v0 .. v0 + NVP - 1 (rows 16 v0 .. of the tile)
        v0 = args[16]
        vs = [builder.add(v0, i64(j)) for j in range(NVP)]
        f_slots = [[cgutils.alloca_once_value(builder, ir.Constant(VF, None)) for _ in range(NVP)]
                   for _ in range(nr)]

        def group(g, j, ptrs):
            """Add group g of vector vs[j] to the nr rows' sums: unpacked once, used nr times."""
            v = vs[j]
            u = _unpack(builder, fam, builder.gep(qp, [builder.add(builder.mul(g, i64(gbytes)),
                                                                   builder.mul(v, i64(LANES * 4)))]))
            scl = _scales(builder, sc, z, sp, g, G, builder.mul(v, i64(LANES)), builder.mul(v, i64(LANES * 2)))
            for i in range(nr):
                slot = f_slots[i][j]
                builder.store(_row_group(builder, sc, z, builder.load(slot), u, scl, *ptrs[i]), slot)

        pf, pfb = args[17], args[18]
        pfn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(
            ir.VoidType(), [I8.as_pointer(), I32, I32, I32]), "llvm.prefetch.p0")

        def prefetch(g):
            """Prefetch the pfb bytes at pf + g pfb from the tile into L2 (pfb = 0: none): a pass spreads its share
            of the next tile over its groups."""
            base = builder.gep(qp, [builder.add(pf, builder.mul(g, pfb))])
            with cgutils.for_range_slice(builder, i64(0), pfb, i64(64)) as (line, _):
                builder.call(pfn, [builder.gep(base, [line]), ir.Constant(I32, 0), ir.Constant(I32, 2),
                                   ir.Constant(I32, 1)])

        if groups_outer:  # the NVP x nr sums in registers, the weights read in memory order
            with cgutils.for_range(builder, G) as loop:
                prefetch(loop.index)
                ptrs = [row(loop.index, i) for i in range(nr)]
                for j in range(NVP):
                    group(loop.index, j, ptrs)
        else:             # Q6: one vector at a time, groups inner (fewer live registers)
            for j in range(NVP):
                with cgutils.for_range(builder, G) as loop:
                    if j == 0:
                        prefetch(loop.index)
                    group(loop.index, j, [row(loop.index, i) for i in range(nr)])
        for i in range(nr):
            for j in range(NVP):
                p = builder.gep(fp, [builder.add(builder.mul(ostride, i64(i)), builder.mul(vs[j], i64(LANES)))])
                builder.store(builder.load(f_slots[i][j]), builder.bitcast(p, VF.as_pointer()), align=4)
        return context.get_dummy_value()

    ip = types.intp
    if nr == 1:
        def typer(typingctx, out, oo, ostride, q, qo, s, so, xq, xo, xd, xdo, xs, xso, xi, xio, G):
            return types.void(out, ip, ip, q, ip, s, ip, xq, ip, xd, ip, xs, ip, xi, ip, ip), codegen
    else:
        def typer(typingctx, out, oo, ostride, q, qo, s, so, xq, xo, xd, xdo, xs, xso, xi, xio, G, v0, pf, pfb):
            return types.void(out, ip, ip, q, ip, s, ip, xq, ip, xd, ip, xs, ip, xi, ip, ip, ip, ip, ip), codegen

    typer.__name__ = f"tile_{fam}_{sc}_{z}_x{nr}"
    return intrinsic(typer)


NR = 4    # activation rows per pass of the batched tile kernels
NVP = 2   # 16-row weight vectors per pass of the batched tile kernels (half a tile)

# tile_<type>_1(out, oo, ostride, q, qo, s, so, xq, xo, xd, xdo, xs, xso, xi, xio, G):
# out.flat[oo + i * ostride : + 64] = the 64 rows of one tile (G groups at q.flat[qo:], its scale record at
# s.flat[so:]) times activation row i (xq.flat[xo + 32 G i:] (32 G) i8, its scales xd.flat[xdo + G i:] (G), its
# scaled half sums xs.flat[xso + 2 G i:] (G, 2), its integer half sums xi.flat[xio + 2 G i:] (G, 2)), i < 1;
# tile_<type>_n(..., G, v0, pf, pfb): the same for i < NR and the tile's rows 16 v0 .. 16 (v0 + NVP) - 1 only
# (out.flat[oo + i * ostride + 16 v0 : + 16 NVP]), prefetching q.flat[qo + pf + g pfb : + pfb] into L2 with group g
# (pfb = 0: none; lumen.kernels.matmul.tiles spreads the next tile over a tile's passes this way).
tile_q4_0_1, tile_q4_0_n = _make_tile(0, SC_D, 8, 1), _make_tile(0, SC_D, 8, NR)
tile_q4_1_1, tile_q4_1_n = _make_tile(0, SC_DM, 8, 1), _make_tile(0, SC_DM, 8, NR)
tile_q4_k_1, tile_q4_k_n = _make_tile(0, SC_K, 8, 1), _make_tile(0, SC_K, 8, NR)
tile_q5_0_1, tile_q5_0_n = _make_tile(Q5, SC_D, 16, 1), _make_tile(Q5, SC_D, 16, NR)
tile_q5_1_1, tile_q5_1_n = _make_tile(Q5, SC_DM, 16, 1), _make_tile(Q5, SC_DM, 16, NR)
tile_q5_k_1, tile_q5_k_n = _make_tile(Q5, SC_K, 16, 1), _make_tile(Q5, SC_K, 16, NR)
tile_q6_k_1, tile_q6_k_n = _make_tile(Q6, SC_K6, 32, 1), _make_tile(Q6, SC_K6, 32, NR)
tile_q8_0_1, tile_q8_0_n = _make_tile(Q8, SC_D, 128, 1), _make_tile(Q8, SC_D, 128, NR)


@intrinsic
def prefetch_lines(typingctx, a, off, nbytes):
    """Prefetch a.flat[off : off + nbytes] (bytes of a u8 array) into L2, one prefetcht1 per 64-byte line."""
    def codegen(context, builder, sig, args):
        arr, o, n = args
        p = ptr(context, builder, sig.args[0], arr, I8, o)
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [I8.as_pointer(), I32,
                                                                                            I32, I32]),
                                            "llvm.prefetch.p0")
        lines = builder.udiv(builder.add(n, i64(63)), i64(64))
        with cgutils.for_range(builder, lines) as loop:
            builder.call(fn, [builder.gep(p, [builder.mul(loop.index, i64(64))]), ir.Constant(I32, 0),
                              ir.Constant(I32, 2), ir.Constant(I32, 1)])
        return context.get_dummy_value()
    return types.void(a, types.intp, types.intp), codegen


# ---- activation rounding (lumen.kernels.matmul.quantize_x): the vector parts of one block of 32 or 256 values

@intrinsic
def absmax(typingctx, x, xo, n):
    """max |x.flat[xo : xo + n]| (n a multiple of 16; NaNs are skipped, as the scalar `if a > amax` does), f32."""
    def codegen(context, builder, sig, args):
        arr, o, cnt = args
        p = ptr(context, builder, sig.args[0], arr, F32, o)
        acc = cgutils.alloca_once_value(builder, ir.Constant(VF, None))
        with cgutils.for_range(builder, builder.udiv(cnt, i64(LANES))) as loop:
            v = builder.load(builder.bitcast(builder.gep(p, [builder.mul(loop.index, i64(LANES))]),
                                             VF.as_pointer()), align=4)
            a = call(builder, f"llvm.fabs.v{LANES}f32", VF, [v])
            builder.store(call(builder, f"llvm.maxnum.v{LANES}f32", VF, [builder.load(acc), a]), acc)
        return call(builder, f"llvm.vector.reduce.fmax.v{LANES}f32", F32, [builder.load(acc)])
    return types.float32(x, types.intp, types.intp), codegen


@intrinsic
def first_with_abs(typingctx, x, xo, n, amax):
    """The first value of x.flat[xo : xo + n] whose |value| == amax (0 if none; n a multiple of 16), f32."""
    def codegen(context, builder, sig, args):
        arr, o, cnt, am = args
        p = ptr(context, builder, sig.args[0], arr, F32, o)
        found = cgutils.alloca_once_value(builder, ir.Constant(F32, 0.0))
        done = cgutils.alloca_once_value(builder, ir.Constant(ir.IntType(1), 0))
        amv = splat(builder, am, VF)
        i16 = ir.IntType(LANES)
        with cgutils.for_range(builder, builder.udiv(cnt, i64(LANES))) as loop:
            v = builder.load(builder.bitcast(builder.gep(p, [builder.mul(loop.index, i64(LANES))]),
                                             VF.as_pointer()), align=4)
            eq = builder.fcmp_ordered("==", call(builder, f"llvm.fabs.v{LANES}f32", VF, [v]), amv)
            m = builder.bitcast(eq, i16)
            hit = builder.and_(builder.icmp_unsigned("!=", m, ir.Constant(i16, 0)), builder.not_(builder.load(done)))
            with builder.if_then(hit):
                k = call(builder, f"llvm.cttz.i{LANES}", i16, [m, ir.Constant(ir.IntType(1), 1)])
                builder.store(builder.extract_element(v, k), found)
                builder.store(ir.Constant(ir.IntType(1), 1), done)
        return builder.load(found)
    return types.float32(x, types.intp, types.intp, types.float32), codegen


@intrinsic
def quantize_block(typingctx, x, xo, q, qo, xi, xio, scale, n, cap):
    """q.flat[qo + j] = int8(rint(x.flat[xo + j] * scale)) (cap: min(127, .) first), j < n (a multiple of 16), and
    xi.flat[xio + h] = the sum of q's h-th run of 16 values (i32)."""
    def codegen(context, builder, sig, args):
        xa, xo_, qa, qo_, ia, io_, sc, cnt, cp = args
        xp = ptr(context, builder, sig.args[0], xa, F32, xo_)
        qp = ptr(context, builder, sig.args[2], qa, I8, qo_)
        ip = ptr(context, builder, sig.args[4], ia, I32, io_)
        scv = splat(builder, sc, VF)
        c127 = ir.Constant(VF, [127.0] * LANES)
        with cgutils.for_range(builder, builder.udiv(cnt, i64(LANES))) as loop:
            off = builder.mul(loop.index, i64(LANES))
            v = builder.load(builder.bitcast(builder.gep(xp, [off]), VF.as_pointer()), align=4)
            r = call(builder, f"llvm.rint.v{LANES}f32", VF, [builder.fmul(v, scv)])
            capped = builder.select(builder.fcmp_ordered("<", r, c127), r, c127)   # min(127, r): 127 unless r < 127
            r = builder.select(cp, capped, r)
            qi = builder.fptosi(r, VI)
            builder.store(builder.trunc(qi, VB8), builder.bitcast(builder.gep(qp, [off]), VB8.as_pointer()),
                          align=1)
            builder.store(call(builder, f"llvm.vector.reduce.add.v{LANES}i32", I32, [qi]),
                          builder.gep(ip, [loop.index]))
        return context.get_dummy_value()
    return types.void(x, types.intp, q, types.intp, xi, types.intp, types.float32, types.intp, types.boolean), codegen


@intrinsic
def f16_round(typingctx, v):
    """v (f32) rounded to the nearest float16 value (ties to even, subnormals, overflow to inf), as f32: one
    vcvtps2ph / vcvtph2ps pair where the CPU has F16C."""
    def codegen(context, builder, sig, args):
        return builder.fpext(builder.fptrunc(args[0], F16), F32)
    return types.float32(types.float32), codegen
