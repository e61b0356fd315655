"""Emulation of the decode GEMM's block-scaled e4m3 path (decode_kernels.cuh, kBlockScaled) on the CPU.

Follows the kernel's index arithmetic step by step: the grid (N / 16 row tiles, splits from choose_splits), the
block-to-warp assignment, each lane's 16-byte weight and activation loads, their use as mma fragments (assembled
into the 16 x 16 (m16n8k16, sm90) or 16 x 32 (m16n8k32, sm89) operand matrices by the PTX ISA's fragment tables,
which is what the tensor cores compute with), the per-group scaling of the accumulator fragments
(mma_block_scaled: token 8j + 2t + e for c[e] and c[2 + e]), the warps' reduction through `red`, the (row, token)
read-out, the split-K partials and the reduce kernel's epilogue. Products and sums are exact (float64 on e4m3
values), so the result must equal the float64 reference of the dequantized operands to rounding of float64.

Run: python csrc/gemm/decode/emulate_block_scales.py   (prints one line per case; exits non-zero on a mismatch)
"""

import itertools
import sys

import numpy as np
import torch

K_ROWS, WARPS, STEP, STEPS, GROUP = 16, 8, 64, 4, 128
BLOCK = STEP * STEPS  # 256 bytes of K per warp and block


def choose_splits(n, k, sms):
    """scaled_mm_decode.cu choose_splits."""
    tiles = n // K_ROWS
    nblk = -(-k // BLOCK)
    splits = 1
    if tiles < sms:
        splits = max(min(-(-2 * sms // tiles), nblk // WARPS), 1)
    bps = -(-nblk // splits)
    bps = -(-bps // WARPS) * WARPS
    return -(-nblk // bps), bps


def words(row_bytes, off):
    """The 4 little-endian 32-bit words of 16 bytes at `off` as 4 lists of 4 byte values (zeros past the row)."""
    chunk = row_bytes[off:off + 16] if off < len(row_bytes) else np.zeros(16)
    return [list(chunk[4 * i:4 * i + 4]) for i in range(4)]


def add_c_fragments(acc, cmat):
    """Adds the 16 x 8 product `cmat` into the lanes' C fragments (the PTX table of both mma shapes):
    C[g][2t + e] -> c[e], C[g + 8][2t + e] -> c[2 + e] of lane (g, t) = (lane / 4, lane % 4)."""
    for lane in range(32):
        g, t = lane // 4, lane % 4
        for e in range(2):
            acc[lane][e] += cmat[g][2 * t + e]
            acc[lane][2 + e] += cmat[g + 8][2 * t + e]


def mma_sm90(acc, wg, wg8, xs):
    """mma_step on sm90: for word i, one m16n8k16 with a0 = row g low pair, a1 = row g+8 low, a2 = row g high,
    a3 = row g+8 high; b0 = token g low pair, b1 = high. Operand matrices from the PTX fragment table:
    A[g][2t + c] = a0[c], A[g + 8][2t + c] = a1[c], A[g][2t + 8 + c] = a2[c], A[g + 8][2t + 8 + c] = a3[c];
    B[2t + c][g] = b0[c], B[2t + 8 + c][g] = b1[c]; C[g][2t + e] -> c[e], C[g + 8][2t + e] -> c[2 + e]."""
    for i in range(4):
        a = np.zeros((16, 16))
        b = np.zeros((16, 8))
        for lane in range(32):
            g, t = lane // 4, lane % 4
            lo, hi = wg[lane][i][:2], wg[lane][i][2:]
            lo8, hi8 = wg8[lane][i][:2], wg8[lane][i][2:]
            xlo, xhi = xs[lane][i][:2], xs[lane][i][2:]
            for c in range(2):
                a[g][2 * t + c], a[g + 8][2 * t + c] = lo[c], lo8[c]
                a[g][2 * t + 8 + c], a[g + 8][2 * t + 8 + c] = hi[c], hi8[c]
                b[2 * t + c][g], b[2 * t + 8 + c][g] = xlo[c], xhi[c]
        add_c_fragments(acc, a @ b)


def mma_sm89(acc, wg, wg8, xs):
    """mma_step on sm89: m16n8k32 with a = {Wg.x, Wg8.x, Wg.y, Wg8.y}, b = {X.x, X.y}, then the same with z, w.
    PTX table: a0 = row g, k 4t..4t+3; a1 = row g+8, same k; a2 = row g, k 16+4t..; a3 = row g+8; b0 = token g,
    k 4t..; b1 = k 16+4t..."""
    for first, second in ((0, 1), (2, 3)):
        a = np.zeros((16, 32))
        b = np.zeros((32, 8))
        for lane in range(32):
            g, t = lane // 4, lane % 4
            for c in range(4):
                a[g][4 * t + c], a[g + 8][4 * t + c] = wg[lane][first][c], wg8[lane][first][c]
                a[g][16 + 4 * t + c], a[g + 8][16 + 4 * t + c] = wg[lane][second][c], wg8[lane][second][c]
                b[4 * t + c][g], b[16 + 4 * t + c][g] = xs[lane][first][c], xs[lane][second][c]
        add_c_fragments(acc, a @ b)


def emulate(a, w, sa, sb, bias, sms, arch):
    """D (float64) as decode_gemm_kernel<Fp8Ab, OutT, NT, void, true> (+ decode_reduce_kernel) computes it, before
    the final rounding. a (M, K), w (N, K) float64 arrays of e4m3 values; sa (M, K/128), sb (ceil(N/128), K/128)."""
    m, k = a.shape
    n = w.shape[0]
    nt = 1 if m <= 8 else 2
    kgroups = k // GROUP
    splits, bps = choose_splits(n, k, sms)
    nblk = -(-k // BLOCK)
    mma = mma_sm90 if arch == "sm90" else mma_sm89
    partials = np.zeros((splits, 16, n))
    for bx, by in itertools.product(range(n // K_ROWS), range(splits)):
        row0 = bx * K_ROWS
        bs, be = by * bps, min(by * bps + bps, nblk)
        red = np.zeros((WARPS, nt, 32, 4))
        for warp in range(WARPS):
            acc = np.zeros((nt, 32, 4))
            for blk in range(bs + warp, be, WARPS):
                # load_block_scales: s[h][j][e] = sa[8j + 2t + e, 2 blk + h] * sb[row0 / 128, 2 blk + h]
                scale = np.zeros((2, nt, 32, 2))
                for h, j, lane, e in itertools.product(range(2), range(nt), range(32), range(2)):
                    kb, token = 2 * blk + h, 8 * j + 2 * (lane % 4) + e
                    if kb < kgroups and token < m:
                        scale[h, j, lane, e] = sa[token, kb] * sb[row0 // GROUP, kb]
                for h in range(2):  # mma_block_scaled: group h = steps 2h, 2h + 1
                    part = np.zeros((nt, 32, 4))
                    for u in (2 * h, 2 * h + 1):
                        off = blk * BLOCK + u * STEP
                        wg = [words(w[row0 + lane // 4], off + 16 * (lane % 4)) for lane in range(32)]
                        wg8 = [words(w[row0 + lane // 4 + 8], off + 16 * (lane % 4)) for lane in range(32)]
                        for j in range(nt):
                            xs = []
                            for lane in range(32):
                                token = 8 * j + lane // 4
                                xs.append(words(a[token] if token < m else np.zeros(k), off + 16 * (lane % 4)))
                            mma(part[j], wg, wg8, xs)
                    for j, lane, i in itertools.product(range(nt), range(32), range(4)):
                        acc[j, lane, i] += part[j, lane, i] * scale[h, j, lane, i % 2]
            red[warp] = acc
        for tid in range(256):
            row, token = tid % K_ROWS, tid // K_ROWS
            if token < m and token < 8 * nt:
                j, tt = token // 8, token % 8
                src, reg = (row % 8) * 4 + tt // 2, (row // 8) * 2 + tt % 2
                partials[by, token, row0 + row] = red[:, j, src, reg].sum()
    d = partials.sum(axis=0)[:m]
    return d + (bias if bias is not None else 0.0)


def e4m3(shape, gen):
    return torch.randn(shape, generator=gen).clamp(-448, 448).to(torch.float8_e4m3fn).to(torch.float64).numpy()


def main():
    gen = torch.Generator().manual_seed(0)
    cases = [  # (M, N, K, SMs): one and two token tiles, N not a multiple of 128, odd K / 128, split-K
        (1, 48, 384, 132), (5, 144, 640, 4), (9, 16, 1152, 2), (16, 272, 256, 132), (3, 32, 2176, 1),
        (2, 16, 4224, 8), (9, 32, 4352, 8),
    ]
    failed = False
    for (m, n, k, sms), arch in itertools.product(cases, ("sm90", "sm89")):
        a, w = e4m3((m, k), gen), e4m3((n, k), gen)
        sa = (torch.rand(m, k // GROUP, generator=gen, dtype=torch.float64) + 0.5).numpy()
        sb = (torch.rand(-(-n // GROUP), k // GROUP, generator=gen, dtype=torch.float64) + 0.5).numpy()
        bias = torch.randn(n, generator=gen, dtype=torch.float64).numpy()
        ref = (a * np.repeat(sa, GROUP, axis=1)) @ (w * np.repeat(np.repeat(sb, GROUP, axis=0)[:n], GROUP, axis=1)).T
        ref = ref + bias
        got = emulate(a, w, sa, sb, bias, sms, arch)
        err = np.abs(got - ref).max() / max(np.abs(ref).max(), 1e-30)
        splits = choose_splits(n, k, sms)[0]
        print(f"M={m:2d} N={n:4d} K={k:5d} splits={splits} {arch}: max relative error {err:.2e}")
        failed |= not err < 1e-12
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
