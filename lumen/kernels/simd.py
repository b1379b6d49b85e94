"""The quantized tile kernels, written as LLVM vector IR: one 64-row weight tile times 1 or NR activation rows.

LLVM never emits vpdpbusd from Numba loops, and the int16-lane loops it does emit reach a small fraction of the
int8 dot rate. vpdpbusd multiplies 4 unsigned bytes by 4 signed bytes and adds the 4 products
to an int32 lane: 64 products per 512-bit instruction. These intrinsics emit it directly when the CPU has
AVX512-VNNI (llvm.x86.avx512.vpdpbusd.512), else vpmaddubsw and vpmaddwd (AVX512BW or AVX2, as llama.cpp's AVX2
kernels; MADD below), else the same arithmetic as portable vector IR (widen, multiply, add) that any LLVM target
compiles; the integers are the same every way.

The weights are read in the compact layout of lumen.kernels.layout (nibbles plus bit planes, f16 / u8 / i8 scales)
and unpacked in registers: per group of 32 columns and 16 rows, 8 quads (vectors of 4 unsigned bytes per lane,
u = nibble | plane bits << 4). Per group the integer sum is exact (|.| < 2^21): for the types without an offset
(D: Q4_0, Q5_0, Q8_0; K6: Q6_K, per half of 16 columns) it is sum (u - z) x = sum u x - z sum x, started from
-z sum x (the activations' integer half sums xi); for the types with one (DM, K) it is sum u x, and the offset goes
into o. The float step then adds it to the row's sum, each multiply-add fused (llvm.fma: one rounding, the same on
every CPU):
    D   f = fma(d_w * d_x, sum, f)
    DM  f = fma(d_w * d_x, sum, fma(m, sx, f))                       sx = d_x sum x (the activations' xs)
    K   t = fma(d_w, sum, fma(m, sx, t)) over the 8 groups of a block, from 0, then f = fma(d_x, t, f)
        with d_w = d * sc, m = -(dmin * min)  (d, dmin f16; sc, min 6-bit), sx = sum x (xs, unscaled)
    K6  t = fma(s_h, sum_h, t) for h = 0, 1 over the block, then f = fma(d_x, t, f),  s_h = d * sc_h
The K types' activations (Q8_K) have one scale d_x per block of 256 columns, so it multiplies a block's sum once
instead of each group's scale (one vector operation fewer per row and group). The fused form is nearer exact math
than rounding every operation on its own (tests/model/test_fidelity.py holds it to llama.cpp's distance from exact
math), and it is 2 to 3 vector operations fewer per row and group.

Three loop orders, the same operations per row and group in the same order (so the same bits):
- 1 row (decode): groups outer, the 64 row sums in 4 registers, the weights streamed in memory order;
- NR = 4 rows (batched): NVP = 2 vectors of 16 rows (half a tile) per call, groups outer, quads next: each quad
  of the 2 weight vectors is unpacked once and used for the 4 rows, each row's 4 activation bytes broadcast once
  and used for the 2 vectors; 8 integer and 8 float sums in registers. K6 runs its two halves one after the
  other (so its integer sums fit the registers too).
  The next tile is prefetched into L2 while a tile is computed, each pass taking its share, spread over its
  groups, so the DRAM stream overlaps the compute.
- NR2 = 2 rows (two rows of a batch, alone or left after the NR-row passes): the 4 vectors of a whole tile per
  call, as NR's loops, the weights read in memory order once (2 rows one at a time read the tile twice and
  compute the second from cache at the one-row kernel's rate).
What bounds the batched kernel is the vector ports, not the weights: every operation beside the vpdpbusd takes a
slot one of them could use (profiling/vnni_ports.py measures each):
- a vpdpbusd whose activation operand is a broadcast from memory runs at half the rate of one that reads a
  register, so each broadcast is used for NVP = 2 vectors (4 would want 16 integer sums and spill the float ones);
- the float step per row and group (convert, 1 multiply but for the K types, 1-2 fused multiply-adds) competes with
  the 8 vpdpbusd, and the unpacking per quad is shared by NR = 4 rows (over a tile unpacked first, for prefill, the
  unpacking and the scale vectors are made once per tile: unpack_<type>).
"""
from __future__ import annotations

import os

import llvmlite.binding as llvm
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from ..format.quants import QT
from .ir import (F16, F32, I8, I32, I64, LANES, VB8, VF, VH, VI, call, fma, fmax, hmax, i64, ivec, mul, ptr,
                 splat, vload)
from .layout import FORMAT, GROUP_BYTES, NIB_BYTES, Q5, Q6, Q8, R, SC_D, SC_DM, SC_K, SC_K6

# A vpdpbusd that the target cannot encode stops LLVM (an abort, not an exception), and one encoded for a CPU
# without it is an illegal instruction. So VNNI is what Numba compiles for, not what this CPU has: NUMBA_CPU_NAME
# and NUMBA_CPU_FEATURES name another target (NUMBA_CPU_NAME=generic for a compile cache any x86-64 can load,
# haswell for an AVX2-only Xeon). Without NUMBA_CPU_FEATURES Numba compiles for this CPU's features, whatever the
# CPU name; with it, only LLVM knows what a CPU name implies, so LLVM is asked, in a child process where a target
# without vpdpbusd may abort (compile_vnni_probe: about 60 ms). Numba keys its cache by the same name and features.
_PROBE = r"""
import sys
import llvmlite.binding as llvm
llvm.initialize_native_target()
llvm.initialize_native_asmprinter()
m = llvm.parse_assembly(sys.argv[3])
t = llvm.Target.from_triple(llvm.get_process_triple())
print(t.create_target_machine(cpu=sys.argv[1], features=sys.argv[2]).emit_assembly(m).count(sys.argv[4]))
"""
_VNNI_IR = "\n".join(
    f"declare <{n} x i32> @llvm.x86.avx512.vpdpbusd.{32 * n}(<{n} x i32>, <{n} x i32>, <{n} x i32>)\n"
    f"define <{n} x i32> @f{n}(<{n} x i32> %x, <{n} x i32> %y, <{n} x i32> %z) {{\n"
    f"  %r = call <{n} x i32> @llvm.x86.avx512.vpdpbusd.{32 * n}(<{n} x i32> %x, <{n} x i32> %y, <{n} x i32> %z)\n"
    f"  ret <{n} x i32> %r\n}}" for n in (8, 16))


def encoded(cpu: str, features: str, module: str, mnemonic: str) -> int:
    """How many `mnemonic` instructions LLVM emits for the IR `module` on the target (a CPU name and a features
    string), asked in a child process (an intrinsic the target cannot encode aborts LLVM there, not here); 0 when
    the child cannot tell: the portable IR runs on any target."""
    import subprocess
    import sys
    try:
        r = subprocess.run([sys.executable, "-c", _PROBE, cpu, features, module, mnemonic], capture_output=True,
                           text=True, timeout=120)
        return int(r.stdout.strip()) if r.returncode == 0 else 0
    except (OSError, subprocess.SubprocessError, ValueError):
        return 0


def compile_vnni_probe(cpu: str, features: str) -> bool:
    """Whether LLVM encodes vpdpbusd, 256- and 512-bit, for the target."""
    return encoded(cpu, features, _VNNI_IR, "vpdpbusd") == 2


def target_has_vnni() -> bool:
    """Whether the CPU Numba compiles for has AVX512-VNNI and 256-bit AVX-512 vectors (avx512vl); see above."""
    from numba.core import config
    if config.CPU_FEATURES is None:
        f = llvm.get_host_cpu_features()
        return bool(f.get("avx512vnni", False) and f.get("avx512vl", False))
    return compile_vnni_probe(config.CPU_NAME or llvm.get_host_cpu_name(), config.CPU_FEATURES)


# LUMEN_NO_VNNI=1 compiles the portable IR even on a VNNI CPU (for tests; lumen/__init__.py gives that build its
# own compile cache, because Numba's cache key knows the CPU but not this switch).
VNNI = os.environ.get("LUMEN_NO_VNNI", "0") in ("", "0") and target_has_vnni()

# Without VNNI, an x86 target with AVX2 (or AVX512BW) computes the same integers by vpmaddubsw (u8 x i8, pairs added
# into i16) and vpmaddwd by ones (pairs of those into i32), as llama.cpp's AVX2 kernels do: 2 instructions per 4-byte
# dot, where the portable IR (widen to i32, multiply, add 4 lanes) takes many (a haswell build prefilled 29x slower
# than this one, skylake-avx512 12x). vpmaddubsw saturates its i16 pair sums, which bytes up to 127 never reach
# (|x| <= 127: 2 x 127 x 127 < 2^15); the Q8 family's bytes (q + 128, up to 255) go as |q| times x with q's sign
# (_dpbusd's offset). MADD: 512 (AVX512BW), 256 (AVX2), or 0 (the portable IR).
def _madd_probe(cpu: str, features: str, width: int) -> bool:
    """Whether LLVM encodes a `width`-bit vpmaddubsw for the target (encoded)."""
    kind = "avx512.pmaddubs.w.512" if width == 512 else "avx2.pmadd.ub.sw"
    b, h = ("<64 x i8>", "<32 x i16>") if width == 512 else ("<32 x i8>", "<16 x i16>")
    module = (f"declare {h} @llvm.x86.{kind}({b}, {b})\n"
              f"define {h} @a({b} %x, {b} %y) {{\n  %r = call {h} @llvm.x86.{kind}({b} %x, {b} %y)\n  ret {h} %r\n}}")
    return encoded(cpu, features, module, "vpmaddubsw") == 1


def target_madd() -> int:
    """The widest vpmaddubsw of the CPU Numba compiles for: 512 (AVX512BW), 256 (AVX2), 0 (none, or not x86)."""
    from numba.core import config
    if not llvm.get_process_triple().startswith(("x86_64", "i686", "i386")):
        return 0
    if config.CPU_FEATURES is None:
        f = llvm.get_host_cpu_features()
        return 512 if f.get("avx512bw", False) else 256 if f.get("avx2", False) else 0
    cpu = config.CPU_NAME or llvm.get_host_cpu_name()
    for width in (512, 256):
        if _madd_probe(cpu, config.CPU_FEATURES, width):
            return width
    return 0


MADD = 0 if VNNI else target_madd()

ROWS = R                       # rows of a tile; LANES (lumen.kernels.ir) = 16 rows per vector (i32 lanes)


# ---- 256-bit helpers (lumen.machine's int8 dot measures with these)

def _madd(builder, u, x, n):
    """Per i32 lane of n: the sum of the 4 products u8 x i8 of u and x (n x i32 vectors), by vpmaddubsw and vpmaddwd
    by ones (MADD); the i16 pair sums must not saturate (see MADD)."""
    width = 512 if MADD == 512 and n == 16 else 256
    k = width // 32                                   # i32 lanes per instruction
    b8, h16, v32 = ir.VectorType(I8, 4 * k), ir.VectorType(ir.IntType(16), 2 * k), ir.VectorType(I32, k)
    ubs = cgutils.get_or_insert_function(builder.module, ir.FunctionType(h16, [b8, b8]),
                                         "llvm.x86.avx512.pmaddubs.w.512" if width == 512 else
                                         "llvm.x86.avx2.pmadd.ub.sw")
    wd = cgutils.get_or_insert_function(builder.module, ir.FunctionType(v32, [h16, h16]),
                                        "llvm.x86.avx512.pmaddw.d.512" if width == 512 else "llvm.x86.avx2.pmadd.wd")
    ones = ir.Constant(h16, [1] * (2 * k))
    parts = []
    for h in range(n // k):                           # the k-lane pieces of the n lanes
        idx = ir.Constant(ir.VectorType(I32, k), list(range(h * k, (h + 1) * k)))
        up = builder.bitcast(u if k == n else builder.shuffle_vector(u, u, idx), b8)
        xp = builder.bitcast(x if k == n else builder.shuffle_vector(x, x, idx), b8)
        parts.append(builder.call(wd, [builder.call(ubs, [up, xp]), ones]))
    if len(parts) == 1:
        return parts[0]
    return builder.shuffle_vector(parts[0], parts[1], ir.Constant(ir.VectorType(I32, n), list(range(n))))


def _dpbusd(builder, acc, u, x, offset: int = 0):
    """acc + per lane: sum of 4 u8 bytes of u times the 4 i8 bytes of x (8 or 16 x i32 vectors). offset 128 (only
    where MADD): u's bytes are q + 128 (the Q8 family's zero point) and the sum is of q times x, i.e. 128 times the
    lane's sum of x less (the caller starts from 0 instead of -128 sum x)."""
    vt = acc.type
    n = vt.count
    if offset:
        assert offset == 128 and MADD and not VNNI
        b = ir.VectorType(I8, 4 * n)
        zero = ir.Constant(b, [0] * (4 * n))
        q = builder.bitcast(builder.xor(u, ir.Constant(vt, [-0x7F7F7F80] * n)), b)    # (0x80808080 as i32)
        xb = builder.bitcast(x, b)
        neg = builder.icmp_signed("<", q, zero)
        aq = builder.select(neg, builder.sub(zero, q), q)          # |q|: -128 wraps to 0x80, 128 unsigned
        xs = builder.select(neg, builder.sub(zero, xb), xb)        # x with q's sign (|x| <= 127: no wrap)
        return builder.add(acc, _madd(builder, builder.bitcast(aq, vt), builder.bitcast(xs, vt), n))
    if VNNI:
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vt, [vt] * 3),
                                            f"llvm.x86.avx512.vpdpbusd.{32 * n}")
        return builder.call(fn, [acc, u, x])
    if MADD:
        return builder.add(acc, _madd(builder, u, x, n))
    # the portable IR: byte b of every lane by shifts on the lanes themselves (u's zero-extended, x's sign-extended),
    # never a vector of 4n widened bytes and its strided shuffles, which targets without AVX2 split into so many
    # pieces that one kind of matmul_kernel took 37 s to compile for x86-64-v2 (10 s native)
    def const(v):
        return ir.Constant(vt, [v] * n)
    for b in range(4):
        ub = builder.and_(builder.lshr(u, const(8 * b)), const(0xFF)) if b < 3 else builder.lshr(u, const(24))
        xb = builder.ashr(builder.shl(x, const(24 - 8 * b)), const(24)) if b < 3 else builder.ashr(x, const(24))
        acc = builder.add(acc, builder.mul(ub, xb))
    return acc


# The intrinsics take whole C-contiguous arrays and flat element offsets into them, not views: a view made in
# a hot loop costs an atomic increment and decrement of the parent's reference count, and when two threads do
# that on one array the count's cache line moves between the cores on every call.

def _unpack(builder, fam, wg, k):
    """Quad k (4 unsigned bytes per lane: columns 4k..4k+3) of 16 rows of one group: wg (i8*) points at the group's
    bytes plus the rows' offset in a 256-byte run. Loads what quad k needs (L1-resident; LLVM keeps what it can)."""
    if fam == Q8:
        return vload(builder, wg, k * ROWS * 4, VI)
    w = vload(builder, wg, (k % 4) * ROWS * 4, VI)
    u = builder.and_(w if k < 4 else builder.lshr(w, ivec(4)), ivec(0x0F0F0F0F))
    if fam == Q5:                        # byte b bit k of the plane word -> bit 4 of quad k's byte b
        hb = vload(builder, wg, NIB_BYTES, VI)
        sh = builder.shl(hb, ivec(4 - k)) if k < 4 else builder.lshr(hb, ivec(k - 4)) if k > 4 else hb
        u = builder.or_(u, builder.and_(sh, ivec(0x10101010)))
    elif fam == Q6:                      # word j byte b bits 2m, 2m+1 -> bits 4, 5 of quad 4j+m's byte b
        j, m = divmod(k, 4)
        hb = vload(builder, wg, NIB_BYTES + j * ROWS * 4, VI)
        sh = builder.shl(hb, ivec(4 - 2 * m)) if m < 2 else hb if m == 2 else builder.lshr(hb, ivec(2))
        u = builder.or_(u, builder.and_(sh, ivec(0x30303030)))
    return u


def _scales(builder, sc, sp, g, G, v1, v2, h):
    """The scale vectors (d_w, o) of 16 rows in group g: o the offset's (DM, K; None for D and K6); for K6, d_w is
    half h's, s_h = d * sc_h. sp (i8*): the tile's scale record; v1, v2: the rows' offset in bytes of a u8 / f16
    row vector."""
    if sc == SC_D:
        sg = builder.gep(sp, [builder.add(builder.mul(g, i64(2 * ROWS)), v2)])
        return builder.fpext(vload(builder, sg, 0, VH), VF), None
    if sc == SC_DM:
        sg = builder.gep(sp, [builder.add(builder.mul(g, i64(4 * ROWS)), v2)])
        d = builder.fpext(vload(builder, sg, 0, VH), VF)
        return d, builder.fpext(vload(builder, sg, 2 * ROWS, VH), VF)
    sg = builder.gep(sp, [builder.add(builder.mul(g, i64(2 * ROWS)), v1)])
    blk = builder.add(builder.mul(G, i64(2 * ROWS)),
                      builder.mul(builder.udiv(g, i64(8)), i64((4 if sc == SC_K else 2) * ROWS)))
    sb = builder.gep(sp, [builder.add(blk, v2)])
    d = builder.fpext(vload(builder, sb, 0, VH), VF)
    if sc == SC_K:
        scale = builder.uitofp(vload(builder, sg, 0, VB8), VF)
        mn = builder.uitofp(vload(builder, sg, ROWS, VB8), VF)
        dmin = builder.fpext(vload(builder, sb, 2 * ROWS, VH), VF)
        return mul(builder, d, scale), builder.fneg(mul(builder, dmin, mn))
    assert sc == SC_K6
    return mul(builder, d, builder.sitofp(vload(builder, sg, h * ROWS, VB8), VF)), None


# An unpacked tile's group: the 8 quads of its 64 rows (the Q8 family's layout), then its scale vectors as f32,
# made once per tile by unpack_<type> instead of once per NR-row pass: d_w of half h at QUAD_BYTES + h * SCALE_ROW,
# o after d_w (the types with one half), a row's at 4 bytes x its index.
QUAD_BYTES = GROUP_BYTES[Q8]
SCALE_ROW = 4 * ROWS
UNPACKED_GROUP = QUAD_BYTES + 2 * SCALE_ROW


def _unpacked_scales(builder, sc, wg, h):
    """_scales of 16 rows read from an unpacked tile's group: wg (i8*) its quads plus the rows' offset (16 x 4 bytes
    a vector, as the f32 scales')."""
    d = vload(builder, wg, QUAD_BYTES + h * SCALE_ROW, VF)
    return d, vload(builder, wg, QUAD_BYTES + SCALE_ROW, VF) if sc in (SC_DM, SC_K) else None


def _epilogue(builder, f, a, scl, sd, sx):
    """f (16 row sums) + one integer sum a of a group (K6: of a half) of one activation row, with the weights'
    scales scl = (d_w, o) (_scales), the row's scale sd (None: the K types' block sum t, scaled after the block)
    and sum sx broadcast: the float step, each multiply-add fused (llvm.fma, one rounding)."""
    dw, o = scl
    if o is not None:
        f = fma(builder, o, sx, f)
    return fma(builder, dw if sd is None else mul(builder, dw, sd), builder.sitofp(a, VF), f)


def _make_tile(fam: int, sc: int, z: int, nr: int, nvp: int = 0, unpacked: bool = False):
    """The tile kernel of one type for nr = 1, NR or NR2 activation rows, nvp weight vectors per call (NVP or a whole
    tile; the signatures below the definitions); unpacked: over a tile unpack_<type> wrote (quads and f32 scales)."""
    NV = ROWS // LANES
    gbytes = UNPACKED_GROUP if unpacked else GROUP_BYTES[fam]
    halves = ((0, 4), (4, 8)) if sc == SC_K6 else ((0, 8),)   # quads per integer sum
    block = sc in (SC_K, SC_K6)             # the float step per block of 8 groups (one activation scale)
    signed = bool(MADD) and z == 128        # bytes q + 128 past vpmaddubsw's range: q x x directly (_dpbusd)

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
        if nr == 1:
            vs, pf, pfb = [i64(j) for j in range(NV)], None, None
        else:
            v0, pf, pfb = args[16], args[17], args[18]
            vs = [builder.add(v0, i64(j)) for j in range(nvp or NVP)]
        # the row sums, in registers (allocas LLVM promotes): nr x len(vs) of them, beside as many integer sums
        slots = [[cgutils.alloca_once_value(builder, ir.Constant(VF, None)) for _ in vs] for _ in range(nr)]
        sums = [[cgutils.alloca_once_value(builder, ir.Constant(VF, None)) for _ in vs] for _ in range(nr)] \
            if block else slots                                  # the K types' block sums t
        pfn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(
            ir.VoidType(), [I8.as_pointer(), I32, I32, I32]), "llvm.prefetch.p0")

        def prefetch(g):
            """Prefetch the pfb bytes at pf + g pfb from the tile into L2 (pfb = 0: none): a pass spreads its share
            of the next tile over its groups."""
            base = builder.gep(qp, [builder.add(pf, builder.mul(g, pfb))])
            with cgutils.for_range_slice(builder, i64(0), pfb, i64(64)) as (line, _):
                builder.call(pfn, [builder.gep(base, [line]), ir.Constant(I32, 0), ir.Constant(I32, 2),
                                   ir.Constant(I32, 1)])

        def group(g):
            """Group g's integer sums of every row and vector, added to `sums` by the float step."""
            if pf is not None:
                prefetch(g)
            wg = [builder.gep(qp, [builder.add(builder.mul(g, i64(gbytes)), builder.mul(v, i64(LANES * 4)))])
                  for v in vs]
            rows = []                        # per activation row: its bytes, integer half sums, scale, scaled sum
            for i in range(nr):
                gi = builder.add(g, builder.mul(G, i64(i)))
                rows.append((builder.gep(xp, [builder.mul(gi, i64(32))]), builder.gep(xip, [builder.mul(gi, i64(2))]),
                             builder.gep(dp, [gi]), builder.gep(sxp, [gi])))
            for h, (k0, k1) in enumerate(halves):
                acc = []                     # acc[i][j]: row i, weight vector j; from -z * sum x (z = 0: zero)
                for xg, xig, _, _ in rows:
                    if z and not signed:
                        c = [builder.load(builder.gep(xig, [ir.Constant(I32, e)])) for e in range(2)]
                        c = c[h] if sc == SC_K6 else builder.add(c[0], c[1])
                        init = splat(builder, builder.neg(builder.shl(c, ir.Constant(I32, z.bit_length() - 1))), VI)
                    else:
                        init = ir.Constant(VI, None)
                    acc.append([init] * len(vs))
                for k in range(k0, k1):      # quad outer: each unpacked quad used for nr rows, each broadcast for
                    u = [_unpack(builder, fam, w, k) for w in wg]          # the len(vs) weight vectors
                    for a, (xg, _, _, _) in zip(acc, rows):
                        p = builder.bitcast(builder.gep(xg, [ir.Constant(I32, 4 * k)]), I32.as_pointer())
                        b = splat(builder, builder.load(p, align=1), VI)
                        for j in range(len(vs)):
                            a[j] = _dpbusd(builder, a[j], u[j], b, 128 if signed else 0)
                scl = [_unpacked_scales(builder, sc, w, h) if unpacked else
                       _scales(builder, sc, sp, g, G, builder.mul(v, i64(LANES)), builder.mul(v, i64(LANES * 2)), h)
                       for v, w in zip(vs, wg)]
                for a, (_, _, dg, sxg), row in zip(acc, rows, sums):
                    sd = None if block else splat(builder, builder.load(dg), VF)
                    sx = splat(builder, builder.load(sxg), VF) if sc in (SC_DM, SC_K) else None
                    for j, p in enumerate(row):
                        builder.store(_epilogue(builder, builder.load(p, align=4), a[j], scl[j], sd, sx), p, align=4)

        if not block:
            with cgutils.for_range(builder, G) as loop:
                group(loop.index)
        else:
            with cgutils.for_range(builder, builder.udiv(G, i64(8))) as loop:
                for row in sums:
                    for p in row:
                        builder.store(ir.Constant(VF, None), p)
                b8 = builder.mul(loop.index, i64(8))
                with cgutils.for_range(builder, i64(8)) as inner:
                    group(builder.add(b8, inner.index))
                for i, (row, trow) in enumerate(zip(slots, sums)):
                    sd = splat(builder, builder.load(builder.gep(dp, [builder.add(b8, builder.mul(G, i64(i)))])), VF)
                    for p, t in zip(row, trow):
                        builder.store(fma(builder, sd, builder.load(t), builder.load(p)), p)
        for i, row in enumerate(slots):
            for v, p in zip(vs, row):
                q = builder.gep(fp, [builder.add(builder.mul(ostride, i64(i)), builder.mul(v, i64(LANES)))])
                builder.store(builder.load(p), builder.bitcast(q, VF.as_pointer()), align=4)
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
NVP = 2   # 16-row weight vectors per pass of the batched tile kernels
NR2 = 2   # activation rows of the two-row kernels, which cover a whole tile per pass

# tile_<type>_1(out, oo, ostride, q, qo, s, so, xq, xo, xd, xdo, xs, xso, xi, xio, G):
# out.flat[oo + i * ostride : + 64] = the 64 rows of one tile (G groups at q.flat[qo:], its scale record at
# s.flat[so:]) times activation row i (xq.flat[xo + 32 G i:] (32 G) i8, its scales xd.flat[xdo + G i:] (G), its
# scaled half sums xs.flat[xso + 2 G i:] (G, 2), its integer half sums xi.flat[xio + 2 G i:] (G, 2)), i < 1;
# tile_<type>_n(..., G, v0, pf, pfb): the same for i < NR and the tile's rows 16 v0 .. 16 (v0 + NVP) - 1 only
# (out.flat[oo + i * ostride + 16 v0 : + 16 NVP]), prefetching q.flat[qo + pf + g pfb : + pfb] into L2 with group g
# (pfb = 0: none; lumen.kernels.matmul.tiles spreads the next tile over a tile's passes this way);
# tile_<type>_2(..., G, v0, pf, pfb): as tile_<type>_n for i < NR2 and all 64 rows of the tile (v0 = 0).
def _tiles_of(qt):
    """The 1-row, NR-row and two-row tile kernels of GGML type qt, with its family, scale format and zero point."""
    return _make_tile(*FORMAT[qt], 1), _make_tile(*FORMAT[qt], NR), _make_tile(*FORMAT[qt], NR2, ROWS // LANES)


def _make_unpack(fam: int, sc: int):
    """unpack_<type>(q, qo, s, so, dst, do, G): the G groups of one tile at q.flat[qo:] (family fam's layout, its
    scale record at s.flat[so:] in format sc) written out at dst.flat[do : do + G * UNPACKED_GROUP]: per group the
    quads _unpack makes in registers for the tile kernels, in the Q8 family's layout (one unsigned byte per column,
    lumen.kernels.layout), then the scale vectors _scales makes, as f32. The type's batched kernel then runs on
    them as its `_u` kernel (below), with the same integer sums and float steps, so the same bits; the scales are
    made once per tile instead of once per NR-row pass."""
    halves = 2 if sc == SC_K6 else 1

    def codegen(context, builder, sig, args):
        q, qo, s, so, dst, do, G = args
        qp = ptr(context, builder, sig.args[0], q, I8, qo)
        sp = ptr(context, builder, sig.args[2], s, I8, so)
        dp = ptr(context, builder, sig.args[4], dst, I8, do)
        with cgutils.for_range(builder, G) as loop:
            g = loop.index
            for v in range(ROWS // LANES):
                wg = builder.gep(qp, [builder.add(builder.mul(g, i64(GROUP_BYTES[fam])), i64(v * LANES * 4))])
                og = builder.gep(dp, [builder.add(builder.mul(g, i64(UNPACKED_GROUP)), i64(v * LANES * 4))])
                for k in range(8):
                    u = _unpack(builder, fam, wg, k)
                    builder.store(u, builder.bitcast(builder.gep(og, [i64(k * ROWS * 4)]), VI.as_pointer()),
                                  align=1)
                for h in range(halves):
                    d, o = _scales(builder, sc, sp, g, G, i64(v * LANES), i64(v * LANES * 2), h)
                    for off, vec in ((QUAD_BYTES + h * SCALE_ROW, d), (QUAD_BYTES + SCALE_ROW, o)):
                        if vec is not None:
                            builder.store(vec, builder.bitcast(builder.gep(og, [i64(off)]), VF.as_pointer()),
                                          align=4)
        return context.get_dummy_value()

    def typer(typingctx, q, qo, s, so, dst, do, G):
        ip = types.intp
        return types.void(q, ip, s, ip, dst, ip, ip), codegen
    typer.__name__ = f"unpack_{fam}_{sc}"
    return intrinsic(typer)


def _tile_u(qt):
    """The NR-row tile kernel of GGML type qt reading a tile unpacked by unpack_<type> (the Q8 family's layout, the
    scales as f32, the type's zero point): the tile_<type>_n contract with q, qo the unpacked bytes (s, so unused)."""
    _, sc, z = FORMAT[qt]
    return _make_tile(Q8, sc, z, NR, unpacked=True)


tile_q4_0_1, tile_q4_0_n, tile_q4_0_2 = _tiles_of(QT.Q4_0)
tile_q4_1_1, tile_q4_1_n, tile_q4_1_2 = _tiles_of(QT.Q4_1)
tile_q4_k_1, tile_q4_k_n, tile_q4_k_2 = _tiles_of(QT.Q4_K)
tile_q5_0_1, tile_q5_0_n, tile_q5_0_2 = _tiles_of(QT.Q5_0)
tile_q5_1_1, tile_q5_1_n, tile_q5_1_2 = _tiles_of(QT.Q5_1)
tile_q5_k_1, tile_q5_k_n, tile_q5_k_2 = _tiles_of(QT.Q5_K)
tile_q6_k_1, tile_q6_k_n, tile_q6_k_2 = _tiles_of(QT.Q6_K)
tile_q8_0_1, tile_q8_0_n, tile_q8_0_2 = _tiles_of(QT.Q8_0)
# (the Q8 family needs none; lumen.kernels.policy.UNPACK_ROWS has the figures)
tile_q5_0_u, tile_q5_1_u, tile_q5_k_u, tile_q6_k_u = (_tile_u(qt) for qt in (QT.Q5_0, QT.Q5_1, QT.Q5_K, QT.Q6_K))
tile_q4_0_u, tile_q4_1_u, tile_q4_k_u = (_tile_u(qt) for qt in (QT.Q4_0, QT.Q4_1, QT.Q4_K))
UNPACK = {int(qt): _make_unpack(*FORMAT[qt][:2])          # unpack_<type> of the types with a `_u` kernel
          for qt in (QT.Q4_0, QT.Q4_1, QT.Q4_K, QT.Q5_0, QT.Q5_1, QT.Q5_K, QT.Q6_K)}


@intrinsic
def data_at(typingctx, a, off):
    """The address (int64) of a.flat[off]: what a tile kernel takes in place of (a, off) when it is called through
    an entry table (lumen.kernels.matmul.run_one, run_rows and run_unpacked)."""
    if not isinstance(a, types.Array):
        return None

    def codegen(context, builder, sig, args):
        arr = context.make_array(sig.args[0])(context, builder, args[0])
        return builder.ptrtoint(builder.gep(arr.data, [args[1]]), I64)
    return types.int64(a, types.intp), codegen


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
            builder.store(fmax(builder, a, builder.load(acc)), acc)        # a NaN in a keeps acc
        return hmax(builder, builder.load(acc))
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
