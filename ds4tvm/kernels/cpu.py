"""Hand-written CPU kernels for the quantized linears of every plane format (F32, F16, BF16,
Q8_0, Q4_1, Q4_K, Q2_K, Q6_K, MXFP4, IQ2_XXS), written in TVMScript because their register
blocking is beyond the TE schedules in schedules/llvm.py (which keep the shapes these do not take).

The core is a micro-kernel of TB tokens x NR output rows whose TB*NR accumulators are 16-lane
vectors of partial sums over k, summed in halves (16->8->4->2->1) at the end, each weight vector
loaded once for TB tokens and each token vector once for NR rows. TB and NR follow the target's
vector registers (Blocking): 6 x 4 with AVX-512 (24 of its 32 registers); 3 x 2 with AVX2, where
an accumulator takes two of the 16 registers (6 x 4 spilled there: 2.5-3.6x slower at 64
tokens). The order of a token's sums does not depend on TB or NR. Weights come from
kernels/dequant.py's expressions (gguf's float operations, so every path rounds alike), VW lanes at a
time, the k loop unrolled over one block of the format so that its scales are loaded and
converted once. Output rows go in tiles of RB; with fewer than HT tokens a tile's weights are
dequantized in registers inside the micro-kernel; with more the tile is dequantized once into a
[RB, K] buffer (32 KB at K = 512) that every token block reads (from 12 tokens for the one-plane
formats, from 2 for the others, whose dequantization costs more than the product). Leftover
tokens run 4-, 2- and 1-token variants of the same core, so they still share each weight vector. A token's outputs do not depend on the tokens beside it, bit for bit.

Routed experts sort the (token, slot) pairs by expert first (a counting sort in the kernel), list
the experts in use, and deal those experts' row tiles round-robin to the cores (TVM splits a
parallel loop of dynamic extent badly): an expert used by 30 tokens of a prefill is read and
dequantized once instead of 30 times, experts nobody chose cost nothing, and a decode's few
experts keep every core busy (one-token calls in the one-plane formats with float inputs keep the
TE kernel, which is faster there: takes_experts). One-token calls (decode) are built with one row
at a time and deal contiguous runs of tiles, without software prefetch: one sequential stream per
core (_one_stream).

Accumulators are global-scope buffers: TVM keeps one under 1 KB on the stack, where LLVM holds it
in registers, while a "local" one came from the workspace pool at every micro-kernel call (and the
products went through memory).

With int8 set (the default on CPUs with an int8 dot instruction, vpdpbusd or vpmaddubsw;
ds4-compile --float-activations clears it) the Q8_0/Q4_K/Q2_K/IQ2_XXS/MXFP4 kernels quantize their
inputs to int8 first and run kernels/cpu_int8.py's integer micro-kernel in the same tiles and token
blocks.

benchmarks/cpu_kernels.py times each format against the TE kernels; BENCHMARKS.md has the numbers.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as QT
from tvm import tirx
from tvm.script import tirx as T

from ..gguf.quant import plane_format
from . import cpu_int8
from .dequant import DEQUANT, tables


def _find_macro_parser_on_bare_frames():
    """TVMScript finds the parser a macro call expands in through inspect.getouterframes, which
    builds a frame record (reading source lines, scanning sys.modules) for every frame of the
    stack at every macro call: 75% of the time to parse one of these kernels (cProfile, TVM
    0.27). The same search over the bare frames (same frames, same order, same answer)."""
    import sys

    from tvm.script.parser.core.parser import ScriptMacro

    def _find_parser_def(self):
        frame = sys._getframe(0)
        while frame is not None:
            parser = frame.f_globals.get(ScriptMacro.parser_object_name)
            if parser is not None:
                return parser
            frame = frame.f_back
        raise RuntimeError(f"{ScriptMacro.parser_object_name} not available")

    ScriptMacro._find_parser_def = _find_parser_def


_find_macro_parser_on_bare_frames()

RB = 16                           # output rows per tile
PARALLEL_MIN_WEIGHTS = 1 << 16    # smaller linears run on one core (the pool's launch costs more)
ARGS = 7                          # weight arguments of every kernel: Q4_K's five planes, IQ2_XXS's 3 + 2 tables
FORMATS = tuple(DEQUANT)
ONE_PLANE = (QT.F32, QT.F16, QT.BF16, QT.Q8_0)   # one value plane (and a scale): cheap to dequantize


@dataclass(frozen=True)
class Blocking:
    """The micro-kernel's register blocking: `tokens` (TB) x `rows` (NR) accumulators of 16 float
    lanes, which must stay in the target's vector registers (one AVX-512 register each, two AVX2
    ones, four SSE or NEON ones) next to the vectors being multiplied."""
    rows: int
    tokens: int


# by vector register width; 512 and 256 measured (benchmarks/cpu_kernels.py, BENCHMARKS.md), 128
# (x86-64 without AVX2, e.g. the generic `llvm` target, and NEON) sized by the same register count
BLOCKINGS = {512: Blocking(rows=4, tokens=6), 256: Blocking(rows=2, tokens=3), 128: Blocking(rows=2, tokens=1)}


def blocking_for(target) -> Blocking:
    """The Blocking of a TVM CPU target, by the widest float vectors its -mcpu has."""
    from tvm.target import codegen

    has = functools.partial(codegen.target_has_features, target=target)
    return BLOCKINGS[512 if has("avx512f") else 256 if has("avx2") else 128]


def int8_dot_for(target) -> str | None:
    """The int8 dot instruction of a TVM CPU target (kernels/cpu_int8.py), None where it has neither."""
    from tvm.target import codegen

    has = functools.partial(codegen.target_has_features, target=target)
    return cpu_int8.VPDPBUSD if has("avx512vnni") else cpu_int8.VPMADDUBSW if has("avx2") else None


def supports(qtype: QT, N: int, K: int, groups: int = 1) -> bool:
    return qtype in FORMATS and N % (RB * groups) == 0 and K % max(32, GGML_QUANT_SIZES[qtype][0]) == 0


def takes_int8(qtype: QT, K: int, dot: str) -> bool:
    """Whether the int8-activation path (kernels/cpu_int8.py) takes the format with the dot instruction
    and K is a whole number of its 256-weight blocks."""
    return qtype in cpu_int8.FORMATS[dot] and K % cpu_int8.BLOCK == 0


def one_token(tokens) -> bool:
    """Whether a linear's token count is the static 1 of decode (an int; prefill's and verify's are
    symbolic)."""
    return isinstance(tokens, int) and tokens == 1


def takes_experts(qtype: QT, N: int, K: int, tokens, int8: str | None = None) -> bool:
    """Whether expert_linear serves a routed-expert call of `tokens` tokens. A one-token call in
    a one-plane format keeps the TE kernel: there it is faster (Q8_0 0.065 against 0.089 ms per
    call, benchmarks/cpu_kernels.py; decode 0.89x before this was kept), and it sums each output in
    the same order as these kernels, so decode and verify still round alike (tests/unit/test_kernels.py).
    With int8 inputs every call takes the hand kernel: the TE kernel has no int8 path."""
    one_token_te = one_token(tokens) and qtype in ONE_PLANE and not int8
    return supports(qtype, N, K) and not one_token_te


def _unroll(qtype: QT) -> int:
    """Vectors of 16 weights that share a format's scales: a block (at most 256 weights)."""
    return max(1, min(GGML_QUANT_SIZES[qtype][0], 256) // 16)


def _lanes(qtype: QT) -> int:
    """Lanes of one dequantized vector: IQ2_XXS decodes 8 weights per grid entry, so an 8-lane
    vector reads its grid row and sign pattern with one contiguous load each."""
    return 8 if qtype == QT.IQ2_XXS else 16


def _tile_from(qtype: QT) -> int:
    """Tokens from which a tile is dequantized once into a buffer instead of in registers by every
    micro-kernel: formats whose dequantization costs more than the product do so from two tokens."""
    return 12 if qtype in ONE_PLANE else 2


def weight_args(args: list) -> list:
    """The ARGS weight arguments every kernel takes: a format's planes and then its tables, padded
    by repeating the first (never read)."""
    return args + args[:1] * (ARGS - len(args))


def _parallel(threads: int, N: int, K: int) -> bool:
    return threads > 1 and N * K >= PARALLEL_MIN_WEIGHTS


def kernel_tables(qtype: QT, int8: str | None = None) -> dict:
    """The lookup tables a kernel takes after the planes (the int8 path gathers its own)."""
    return cpu_int8.tables(qtype, int8) if int8 else tables(qtype)


def arg_types(qtype: QT, lead: tuple, K: int, int8: str | None) -> list[tuple[tuple, str]]:
    """(shape, dtype) of each weight argument: the planes, then the tables."""
    planes = [((*lead, f.per_row(K)), f.dtype) for f in plane_format(qtype).fields]
    return weight_args(planes + [(t.shape, str(t.dtype)) for t in kernel_tables(qtype, int8).values()])


def dequant_of(qtype: QT):
    names = [f.name for f in plane_format(qtype).fields] + list(tables(qtype))
    deq = DEQUANT[qtype]
    return lambda r, k, ws: deq(dict(zip(names, ws)), r, k)


@T.macro
def _zero(acc, nt, nr):
    for t in T.unroll(nt):
        for n in T.unroll(nr):
            for lane in T.vectorized(16):
                acc[t, n, lane] = T.float32(0)


def _lane_sum(acc, t, n):
    """The 16 lanes of accumulator (t, n) summed in halves (16->8->4->2->1) as shuffles of one
    vector value: in registers, where halving the local buffer in place went through memory."""
    return lane_sum(tirx.BufferLoad(acc, [t, n, tirx.Ramp(0, 1, 16)]))


def lane_sum(v):
    """The lanes of a vector value summed in halves (16->8->4->2->1), as shuffles."""
    return cpu_int8.lanes_reduced(v, lambda a, b: a + b)


@T.macro
def _store_sums(y, acc, nt, nr, y_at, ctx, i0, tile, rb):
    """Each accumulator's lane sum into its output, y_at(ctx, i, tile, r) (a micro-kernel's end)."""
    for t in T.unroll(nt):
        for n in T.unroll(nr):
            T.buffer_store(y, _lane_sum(acc, t, n), y_at(ctx, i0 + t, tile, rb * nr + n))


def _token_blocks(micro, b: Blocking):
    """A macro blocks(inline, first, count, tile, ...) that runs `micro` over token rows first ..
    first+count-1 in blocks of TB, the last count % TB rows in blocks of 4, 2, 1 (still sharing
    each weight vector)."""
    NR, TB = b.rows, b.tokens

    @T.macro
    def blocks(inline, first, count, tile, x, y, ctx, wt, ws):
        for rb in range(RB // NR):
            for blk in range(count // TB):
                micro(inline, TB, first + blk * TB, tile, rb, x, y, ctx, wt, ws)
            if count % TB >= 4:
                micro(inline, 4, first + count // TB * TB, tile, rb, x, y, ctx, wt, ws)
            if count % TB % 4 >= 2:
                micro(inline, 2, first + count // TB * TB + count % TB // 4 * 4, tile, rb, x, y, ctx, wt, ws)
            if count % TB % 2 == 1:
                micro(inline, 1, first + count - 1, tile, rb, x, y, ctx, wt, ws)

    return blocks


def _int8_row_tiles(qtype: QT, K: int, b: Blocking, dot: str, x_loc, w_row, y_at):
    """The row_tile macro of the int8-activation path (kernels/cpu_int8.py): x is the tuple (xq, D, X)
    of quantized inputs, x_loc(ctx, i, tile) the quantized row and first column of list entry i,
    w_row(tile, r) the weight row index of tile row r. Weights are always decoded in registers:
    their codes feed the dot products directly."""
    dec, signed = cpu_int8.block_decoder(qtype, dot), cpu_int8.signed_codes(qtype, dot)
    apart = cpu_int8.signs_apart(qtype, dot)
    NR = b.rows

    def row(ctx, i, tile):
        return x_loc(ctx, i, tile)[0]

    def k0(blk, j):   # weight column of chunk j of block blk
        return blk * cpu_int8.BLOCK + j * cpu_int8.CHUNK

    def col(ctx, i, tile, blk, j):   # input column of chunk j of block blk
        return x_loc(ctx, i, tile)[1] + k0(blk, j)

    def codes(rows, blk, ws, j, part):   # a chunk's codes, or (apart) its magnitudes or signs
        c = dec(rows, blk, ws)[0][j]
        return c[part] if apart else c

    @T.macro
    def update(acc, nt, i0, tile, n, blk, j, u, S, x, ctx):
        for t in T.unroll(nt):
            T.buffer_store(acc, cpu_int8.chunk_update(acc, t, n, u, S, x[0], x[1], row(ctx, i0 + t, tile),
                                                      col(ctx, i0 + t, tile, blk, j), dot, signed),
                           [t, n, tirx.Ramp(0, 1, 16)])

    @T.macro
    def chunk(acc, nt, i0, tile, rb, blk, j, x, ctx, wt, ws):
        for n in T.unroll(NR):   # a row's chunk is decoded once (bound) for all nt tokens
            if wt is not None:   # ... or read from the buffers row_tile_decoded_once filled (signs apart)
                u = T.bind(cpu_int8._vec(wt[0], (rb * NR + n,), k0(blk, j), 64))
                S = T.bind(cpu_int8._vec(wt[2], (rb * NR + n, blk * 4 + j), 0, 16))
                signs = T.bind(cpu_int8._vec(wt[1], (rb * NR + n,), k0(blk, j), 64))
                update(acc, nt, i0, tile, n, blk, j, (u, signs), S, x, ctx)
            else:
                u = T.bind(codes(w_row(tile, rb * NR + n), blk, ws, j, 0))
                S = T.bind(dec(w_row(tile, rb * NR + n), blk, ws)[1][j])
                if apart:
                    signs = T.bind(codes(w_row(tile, rb * NR + n), blk, ws, j, 1))
                    update(acc, nt, i0, tile, n, blk, j, (u, signs), S, x, ctx)
                else:
                    update(acc, nt, i0, tile, n, blk, j, u, S, x, ctx)

    @T.macro
    def decoded_chunk(r, tile, blk, j, ws, wt):
        T.buffer_store(wt[0], codes(w_row(tile, r), blk, ws, j, 0), [r, tirx.Ramp(k0(blk, j), 1, 64)])
        T.buffer_store(wt[1], codes(w_row(tile, r), blk, ws, j, 1), [r, tirx.Ramp(k0(blk, j), 1, 64)])
        T.buffer_store(wt[2], dec(w_row(tile, r), blk, ws)[1][j], [r, blk * 4 + j, tirx.Ramp(0, 1, 16)])

    @T.macro
    def offsets(acc, nt, i0, tile, rb, blk, x, ctx, ws):
        for n in T.unroll(NR):
            M = T.bind(dec(w_row(tile, rb * NR + n), blk, ws)[2])
            for t in T.unroll(nt):
                T.buffer_store(acc, cpu_int8.offset_update(acc, t, n, M, x[2], row(ctx, i0 + t, tile),
                                                           col(ctx, i0 + t, tile, blk, 0)), [t, n, tirx.Ramp(0, 1, 16)])

    @T.macro
    def micro(_inline, nt, i0, tile, rb, x, y, ctx, wt, ws):
        acc = T.decl_buffer((nt, NR, 16), "float32")   # global scope: see the module docstring
        _zero(acc, nt, NR)
        for blk in range(K // cpu_int8.BLOCK):
            chunk(acc, nt, i0, tile, rb, blk, 0, x, ctx, wt, ws)
            chunk(acc, nt, i0, tile, rb, blk, 1, x, ctx, wt, ws)
            chunk(acc, nt, i0, tile, rb, blk, 2, x, ctx, wt, ws)
            chunk(acc, nt, i0, tile, rb, blk, 3, x, ctx, wt, ws)
            if not signed:   # signed codes have no offsets
                offsets(acc, nt, i0, tile, rb, blk, x, ctx, ws)
        _store_sums(y, acc, nt, NR, y_at, ctx, i0, tile, rb)

    blocks = _token_blocks(micro, b)

    @T.macro
    def row_tile(first, count, tile, x, y, ctx, ws):
        blocks(True, first, count, tile, x, y, ctx, None, ws)

    return _decoded_once(blocks, decoded_chunk, b, K) if apart else row_tile


def _decoded_once(blocks, decoded_chunk, b: Blocking, K: int):
    """The int8 row_tile of the table formats whose signs are apart (IQ2_XXS on AVX2): they cost more
    to decode than to multiply, so with many tokens a tile is decoded once into buffers (exact codes
    and scales: the sums are the same bit for bit)."""
    @T.macro
    def row_tile_decoded_once(first, count, tile, x, y, ctx, ws):
        if count > b.tokens:   # more than one token block: decode the tile once, for all of them
            wt = (T.decl_buffer((RB, K), "uint8"), T.decl_buffer((RB, K), "int8"),
                  T.decl_buffer((RB, K // cpu_int8.CHUNK, 16), "float32"))
            for r, blk in T.grid(RB, K // cpu_int8.BLOCK):
                decoded_chunk(r, tile, blk, 0, ws, wt)
                decoded_chunk(r, tile, blk, 1, ws, wt)
                decoded_chunk(r, tile, blk, 2, ws, wt)
                decoded_chunk(r, tile, blk, 3, ws, wt)
            blocks(True, first, count, tile, x, y, ctx, wt, ws)
        else:
            blocks(True, first, count, tile, x, y, ctx, None, ws)

    return row_tile_decoded_once


def _row_tiles(K: int, b: Blocking, VW: int, HT: int, U: int, x_at, w_at, y_at):
    """The tiled product both kernels share, as a macro row_tile(first, count, tile, x, y, ctx, ws):
    output rows tile*RB .. for the `count` token rows first .. first+count-1 of a list. The
    accessors, evaluated while parsing, say where those rows live: x_at(x, ctx, i, tile, k) the
    input of list entry i, y_at(ctx, i, tile, r) the output index of entry i and tile row r,
    w_at(inline, tile, r, k, wt, ws) weight row r of the tile (dequantized from the weight
    arguments ws, or read from wt). Weights are dequantized VW lanes at a time, into wt from HT
    tokens; the k loop is unrolled by U vectors of 16 (a block of the format), so the block's
    scales are loaded and converted once for all its vectors."""
    KC, H, NR = K // 16, 16 // VW, b.rows

    def unroll(dequantizing):   # reading a dequantized tile has no scales to share
        return U if dequantizing else 1

    def k_of(kb, u, h, lane, dequantizing):   # column of lane `lane` of half h of vector kb*unroll + u
        return (kb * unroll(dequantizing) + u) * 16 + h * VW + lane

    @T.macro
    def micro(inline, nt, i0, tile, rb, x, y, ctx, wt, ws):
        acc = T.decl_buffer((nt, NR, 16), "float32")   # global scope: see the module docstring
        _zero(acc, nt, NR)
        for kb in range(KC // unroll(inline)):
            for u in T.unroll(unroll(inline)):
                for t in T.unroll(nt):
                    for n in T.unroll(NR):
                        for h in T.unroll(H):
                            for lane in T.vectorized(VW):
                                acc[t, n, h * VW + lane] = acc[t, n, h * VW + lane] + x_at(
                                    x, ctx, i0 + t, tile, k_of(kb, u, h, lane, inline)) * w_at(
                                    inline, tile, rb * NR + n, k_of(kb, u, h, lane, inline), wt, ws)
        _store_sums(y, acc, nt, NR, y_at, ctx, i0, tile, rb)

    blocks = _token_blocks(micro, b)

    @T.macro
    def row_tile(first, count, tile, x, y, ctx, ws):
        if count >= HT:
            wt = T.decl_buffer((RB, K), "float32")
            for r, kb in T.grid(RB, KC // U):
                for u in T.unroll(U):
                    for h in T.unroll(H):
                        for lane in T.vectorized(VW):
                            wt[r, k_of(kb, u, h, lane, True)] = w_at(True, tile, r, k_of(kb, u, h, lane, True), wt, ws)
            blocks(False, first, count, tile, x, y, ctx, wt, ws)
        elif HT <= 2:   # one token: only the one-token micro-kernel is ever run here
            for rb in range(RB // NR):
                micro(True, 1, first, tile, rb, x, y, ctx, None, ws)
        else:
            blocks(True, first, count, tile, x, y, ctx, None, ws)

    return row_tile


def _tiles(qtype: QT, K: int, b: Blocking, int8: str | None, x_at, x_loc, w_row, y_at):
    """The row_tile macro of the float path (x_at: an input element) or of the int8 path (x_loc:
    a quantized input row and its first column); w_row(tile, r): the weight row of tile row r."""
    if int8:
        return _int8_row_tiles(qtype, K, b, int8, x_loc, w_row, y_at)
    deq = dequant_of(qtype)

    def w_at(inline, tile, r, k, wt, ws):
        return deq(w_row(tile, r), k, ws) if inline else wt[r, k]

    return _row_tiles(K, b, _lanes(qtype), _tile_from(qtype), _unroll(qtype), x_at, w_at, y_at)


@functools.cache
def source_digest() -> str:
    """What a kernel's TIR follows from besides its arguments: the sources that write it (this
    package's and the plane layouts') and TVM."""
    import hashlib
    import pathlib

    import tvm
    import tvm_ffi

    from ..gguf import quant

    h = hashlib.sha256(f"{tvm.__version__} {tvm_ffi.__version__}".encode())
    for module in (*sorted(pathlib.Path(__file__).parent.glob("*.py")), quant.__file__):
        h.update(pathlib.Path(module).read_bytes())
    return h.hexdigest()[:16]


def _parsed_once(build):
    """One PrimFunc per shape, shared by the layers and kept on disk (cache.kernel_cache()):
    parsing the TVMScript of one kernel takes 0.1-0.3 s (1-4 s before
    _find_macro_parser_on_bare_frames), and a model has dozens. The key is the arguments and a
    digest of the sources that write the kernel and of TVM's versions, so a file read back was
    written by this TVM: it is loaded as it is, without tvm.ir.load_json's pass upgrading older
    formats (~1 s of a tiny model's export in a fresh process)."""
    import hashlib
    import os

    import tvm
    from tvm_ffi.serialization import from_json_graph_str

    from ..cache import kernel_cache

    @functools.lru_cache(maxsize=None)
    @functools.wraps(build)
    def get(*args):
        key = hashlib.sha256(repr((build.__name__, args, source_digest())).encode()).hexdigest()[:32]
        path = kernel_cache() / f"{build.__name__}-{key}.json"
        try:
            return from_json_graph_str(path.read_text())
        except (OSError, ValueError, RuntimeError):   # absent or unreadable: parse it again
            pass
        func = build(*args)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(tvm.ir.save_json(func))
            os.replace(tmp, path)   # whole or absent for a reader in another process
        except OSError:
            pass
        return func

    return get


def _prefetch_tile(qtype: QT, K: int):
    """A macro prefetch(ws, at) asking for the cache lines of the next row tile a core will read,
    in the format's largest plane, element at(r, c) for tile row r, column c: the hardware
    prefetcher alone left a one-token call at half the memory's speed (a Q8_0 71 MB matrix: int8
    11.6 -> 18.9 GB/s, float 10.2 -> 12.4; BENCHMARKS.md). None for IQ2_XXS: its kernels, which
    read table rows by index, ran 10-90% slower with it."""
    import tvm

    fields = plane_format(qtype).fields
    size = [f.per_row(K) * tvm.DataType(f.dtype).bits // 8 for f in fields]
    big = size.index(max(size))
    elems = fields[big].per_row(K)
    per_line = 64 * elems // size[big]   # elements per 64-byte line

    lines = 0 if qtype == QT.IQ2_XXS else RB * elems // per_line

    @T.macro
    def prefetch(ws, at):
        for ln in range(lines):
            T.evaluate(T.call_llvm_intrin("void", "llvm.prefetch", T.address_of(
                ws[big][at(ln * per_line // elems, ln * per_line % elems)]), T.int32(0), T.int32(3), T.int32(1)))

    return prefetch


def _one_stream(blocking: Blocking) -> bool:
    """Whether a kernel reads its rows one after another (rows=1: one-token calls, kernels/forms.py),
    a sequential stream per core that the hardware prefetcher follows alone: asking for the next
    tile as well made such a call slower (a Q8_0 2048 x 512 int8 GEMV from memory: 34 us without,
    49 us with; routed experts dealt round-robin 83 us, as contiguous runs 41 us; BENCHMARKS.md)."""
    return blocking.rows == 1


@_parsed_once
def dense_linear(qtype: QT, N: int, K: int, threads: int, blocking: Blocking, groups: int = 1,
                 int8: str | None = None):
    """y[T, N] = x[T, K] @ W[N, K]^T for any T. With groups G, x is [T, G*K] and output rows
    g*N/G .. (g+1)*N/G read x[:, g*K : (g+1)*K] (a grouped projection). int8: the dot
    instruction inputs quantized to int8 feed (kernels/cpu_int8.py), or None."""
    parallel = _parallel(threads, N, K)
    rows_per_group = N // groups
    a = arg_types(qtype, (N,), K, int8)

    def x_at(x, _ctx, i, rt, k):   # a tile's input columns are its group's slice of x
        return x[i, rt * RB // rows_per_group * K + k]

    def x_loc(_ctx, i, rt):
        return i, rt * RB // rows_per_group * K

    def y_at(_ctx, i, rt, r):
        return [i, rt * RB + r]

    row_tile = _tiles(qtype, K, blocking, int8, x_at, x_loc, lambda rt, r: (rt * RB + r,), y_at)
    prefetch, one_stream = _prefetch_tile(qtype, K), _one_stream(blocking)
    quantize = cpu_int8.quantizer(threads > 1 and not one_stream)

    @T.macro
    def tiles(n_tok, x, y, ws):
        if parallel:
            for rt in T.parallel(N // RB):   # each core takes a run of tiles: prefetch its next
                if not one_stream:
                    prefetch(ws, lambda r, c: (T.min(rt + 1, N // RB - 1) * RB + r, c))
                row_tile(0, n_tok, rt, x, y, None, ws)
        else:
            for rt in T.serial(N // RB):
                row_tile(0, n_tok, rt, x, y, None, ws)

    @T.prim_func(private=True)
    def main(x_h: T.handle, w0: T.Buffer(*a[0]), w1: T.Buffer(*a[1]), w2: T.Buffer(*a[2]), w3: T.Buffer(*a[3]),
             w4: T.Buffer(*a[4]), w5: T.Buffer(*a[5]), w6: T.Buffer(*a[6]), y_h: T.handle):
        T.func_attr({"tirx.noalias": True, "ds4.schedule": "hand"})
        n_tok = T.int32()
        x = T.match_buffer(x_h, (n_tok, groups * K), "float32")
        y = T.match_buffer(y_h, (n_tok, N), "float32")
        if int8 is not None:
            xq = T.decl_buffer((n_tok, groups * K), "int8")
            D = T.decl_buffer((n_tok, groups * K // 4), "float32")
            X = T.decl_buffer((n_tok, groups * K // 16), "float32")
            quantize(x, _row_of_2d, n_tok, groups * K, xq, D, X)
            tiles(n_tok, (xq, D, X), y, (w0, w1, w2, w3, w4, w5, w6))
        else:
            tiles(n_tok, x, y, (w0, w1, w2, w3, w4, w5, w6))

    return main


def _row_of_2d(x, r, k):
    return x[r, k]


@T.macro
def _sort_by_expert(ids, n_tok, J, E, cnt, off, fill, used, slots):
    """A counting sort of the (token, slot) pairs by expert: slots[off[e] .. off[e] + cnt[e]] hold
    expert e's; used[:used[E]] the experts chosen at least once."""
    for e in range(E):
        cnt[e] = 0
    for s in range(n_tok * J):
        cnt[ids[s // J, s % J]] = cnt[ids[s // J, s % J]] + 1
    off[0] = 0
    used[E] = 0
    for e in range(E):
        off[e + 1] = off[e] + cnt[e]
        fill[e] = off[e]
        if cnt[e] > 0:   # experts nobody chose cost nothing
            used[used[E]] = e
            used[E] = used[E] + 1
    for s in range(n_tok * J):
        slots[fill[ids[s // J, s % J]]] = s
        fill[ids[s // J, s % J]] = fill[ids[s // J, s % J]] + 1


@_parsed_once
def expert_linear(qtype: QT, E: int, N: int, K: int, J: int, per_slot_input: bool, threads: int,
                  blocking: Blocking, int8: str | None = None):
    """y[T, J, N] = x[T, (J|1), K] @ W[ids[t, j], N, K]^T for any T, grouped by expert: the
    (token, slot) pairs are sorted by expert, and the row tiles of the experts in use (in order
    of expert id) are shared among the cores, so a decode's six experts keep both cores busy.
    int8: the dot instruction inputs quantized to int8 feed (kernels/cpu_int8.py), or None."""
    parallel = _parallel(threads, N, K)
    a = arg_types(qtype, (E, N), K, int8)
    NT, XJ = N // RB, (J if per_slot_input else 1)

    def x_at(x, slots, i, _et, k):
        return x[slots[i] // J, slots[i] % J if per_slot_input else 0, k]

    def x_loc(slots, i, _et):   # the quantized inputs are x's rows flattened: [T * XJ, K]
        return (slots[i] // J * XJ + (slots[i] % J if per_slot_input else 0)), 0

    def y_at(slots, i, et, r):
        return [slots[i] // J, slots[i] % J, et % NT * RB + r]

    def x_row(x, r, k):
        return x[r // XJ, r % XJ, k]

    row_tile = _tiles(qtype, K, blocking, int8, x_at, x_loc, lambda et, r: (et // NT, et % NT * RB + r), y_at)

    @T.macro
    def used_tile(ut, x, y, slots, cnt, off, used, ws):
        row_tile(off[used[ut // NT]], cnt[used[ut // NT]], used[ut // NT] * NT + ut % NT, x, y, slots, ws)

    prefetch, one_stream = _prefetch_tile(qtype, K), _one_stream(blocking)
    quantize = cpu_int8.quantizer(threads > 1 and not one_stream)

    def next_row(used, ut, r):   # row r of the tile after used tile ut, as [expert, row]
        et = used[ut // NT] * NT + ut % NT
        return et // NT, et % NT * RB + r

    @T.macro
    def tiles(n_used, x, y, slots, cnt, off, used, ws):
        if parallel:
            if one_stream:   # one token: every tile costs the same, so a contiguous run each
                for p in T.parallel(threads):
                    for ut in range(p * n_used * NT // threads, (p + 1) * n_used * NT // threads):
                        used_tile(ut, x, y, slots, cnt, off, used, ws)
            else:
                for p in T.parallel(threads):   # tiles dealt round-robin: balanced whatever the experts
                    for i in range((n_used * NT - p + threads - 1) // threads):
                        prefetch(ws, lambda r, c: (*next_row(used, T.min(p + (i + 1) * threads, n_used * NT - 1), r),
                                                   c))
                        used_tile(p + i * threads, x, y, slots, cnt, off, used, ws)
        else:
            for ut in T.serial(n_used * NT):
                used_tile(ut, x, y, slots, cnt, off, used, ws)

    @T.prim_func(private=True)
    def main(x_h: T.handle, ids_h: T.handle, w0: T.Buffer(*a[0]), w1: T.Buffer(*a[1]), w2: T.Buffer(*a[2]),
             w3: T.Buffer(*a[3]), w4: T.Buffer(*a[4]), w5: T.Buffer(*a[5]), w6: T.Buffer(*a[6]), y_h: T.handle):
        T.func_attr({"tirx.noalias": True, "ds4.schedule": "hand"})
        n_tok = T.int32()
        x = T.match_buffer(x_h, (n_tok, XJ, K), "float32")
        ids = T.match_buffer(ids_h, (n_tok, J), "int32")
        y = T.match_buffer(y_h, (n_tok, J, N), "float32")
        cnt = T.decl_buffer((E,), "int32")
        off = T.decl_buffer((E + 1,), "int32")
        fill = T.decl_buffer((E,), "int32")
        used = T.decl_buffer((E + 1,), "int32")   # the experts chosen at least once; their count last
        slots = T.decl_buffer((n_tok * J,), "int32")
        _sort_by_expert(ids, n_tok, J, E, cnt, off, fill, used, slots)
        n_used: T.int32 = used[E]
        if int8 is not None:
            xq = T.decl_buffer((n_tok * XJ, K), "int8")
            D = T.decl_buffer((n_tok * XJ, K // 4), "float32")
            X = T.decl_buffer((n_tok * XJ, K // 16), "float32")
            quantize(x, x_row, n_tok * XJ, K, xq, D, X)
            tiles(n_used, (xq, D, X), y, slots, cnt, off, used, (w0, w1, w2, w3, w4, w5, w6))
        else:
            tiles(n_used, x, y, slots, cnt, off, used, (w0, w1, w2, w3, w4, w5, w6))

    return main
