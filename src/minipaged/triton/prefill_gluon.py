"""Hopper prefill in Gluon, Triton's explicit-layout dialect (issue #16, item 4).

Triton's own compiler runs the two warpgroups of a 128-row program in lock step: one CTA
barrier per key tile, so both warpgroups do their softmax at the same time while the tensor
cores idle. Gluon, shipped in the same Triton package, lets the kernel say what to overlap;
the compiler still picks registers and instructions. This kernel is FlashAttention-3's
schedule written in it:

  * three partitions per CTA: a one-warp loader issuing TMA copies of K and V tiles into
    STAGES-deep rings guarded by mbarriers (ready: the copy landed; empty: both consumers
    are done with it), and two consumer warpgroups of 64 query rows each;
  * the consumers run independently (no CTA barrier in the key loop), so one warpgroup's
    softmax runs while the other's wgmma keep the tensor cores busy;
  * inside a consumer, Q K_j^T of tile j is issued before P_{j-1} V_{j-1}, and the softmax of
    tile j runs while P V is in flight (the accumulator is rescaled after it lands).

When a grid's K/V exceed the L2 (B=1 at 16k keys), the programs run in sections of whole GQA
groups whose K/V fit in half of it, one section after the other (L2_SECTIONS, as the CUDA kernel's
CfgWsL2): in the plain order each wave of programs sweeps every head's keys and evicts what the
next wave reads. OVERLAP and the partitions' register split are knobs for the ablation
(scripts/triton_hopper_ab.py, bench/results/prefill_ablation.md run 15), not for tuning.

Semantics are prefill._attn_fwd's (read its docstring): bottom-right causal, rows that see
no key store zeros (and lse -inf), GQA by head index, dense or varlen from the same
arguments (prefill.dense_args / varlen_args). Each program builds tensor descriptors over its
own (sequence, head) rows, so TMA clips ragged tiles at the sequence end.

The same partitions serve paged long chunks (_paged_fwd_gluon, ops.paged's long launch on
sm_90): host descriptors over q and the caches, one TMA box per page through the block table,
and V rows past the context zeroed in the last tile (they are other cache slots). At small pages
a tile is many copies, so the loader can run as two warps, one per ring (SPLIT_LOADER).

Gluon kernels run on sm_90 GPUs only, never under the interpreter: `available()` says whether
the installed triton has Gluon, `usable()` / `paged_usable()` whether a call can take them.
"""

from __future__ import annotations

import functools

import torch
import triton

from .launch import fast
from .prefill import _head_bases, _program_rows, _rows_of

try:  # Gluon and its Hopper ops arrived in triton 3.5; older or CPU-only builds lack them
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                  warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    _HAVE_GLUON = True
except ImportError:  # pragma: no cover - depends on the installed triton
    _HAVE_GLUON = False

# Query rows per program: two consumer warpgroups of 64 rows (one wgmma M each); the kernels
# spell these 64 and 128 as literals.
BLOCK_M = 128


def available() -> bool:
    """Whether the installed triton has the Gluon Hopper ops this kernel is written in."""
    return _HAVE_GLUON


def _jit_unspecialised(*names: str):
    """gluon.jit with do_not_specialize=names, or plain gluon.jit where this Triton's lacks it."""
    try:
        return gluon.jit(do_not_specialize=list(names))
    except TypeError:  # pragma: no cover - depends on the installed triton
        return gluon.jit


if _HAVE_GLUON:

    @gluon.jit
    def _key_tiles(q_len, k_len, rows0, IS_CAUSAL: gl.constexpr, BLOCK_N: gl.constexpr):
        """(tiles, unmasked tiles) of keys the 64 rows from rows0 see: rows past q_len are
        never stored, so they do not extend the range."""
        rows_end = gl.minimum(rows0 + 64, q_len)
        if IS_CAUSAL:
            diag = k_len - q_len
            end = gl.minimum(rows_end + diag, k_len)
            full = gl.minimum(rows0 + diag + 1, k_len)
        else:
            end = k_len
            full = k_len
        end = gl.where(rows_end > rows0, gl.maximum(end, 0), 0)
        full = gl.minimum(gl.maximum(full, 0), end)
        return gl.cdiv(end, BLOCK_N), full // BLOCK_N

    @gluon.jit
    def _softmax(s, m_i, l_i, qk_scale_log2, cols, rows, k_len, diag, MASKED: gl.constexpr,
                 IS_CAUSAL: gl.constexpr):
        """Online-softmax update of one [64, BLOCK_N] score tile in the log2 domain.
        -> (p fp32, m, l, alpha). MASKED tiles may leave a row with nothing seen (m -inf):
        it subtracts 0 instead, keeping exp2 away from -inf - -inf."""
        if MASKED:
            if IS_CAUSAL:
                s = gl.where((cols[None, :] < k_len) & (cols[None, :] <= rows[:, None] + diag), s * qk_scale_log2,
                             float("-inf"))
            else:
                s = gl.where(cols[None, :] < k_len, s * qk_scale_log2, float("-inf"))
            m_new = gl.maximum(m_i, gl.max(s, axis=1))
            m_sub = gl.where(m_new == float("-inf"), 0.0, m_new)
            p = gl.exp2(s - m_sub[:, None])
            alpha = gl.exp2(m_i - m_sub)
        else:
            m_new = gl.maximum(m_i, gl.max(s, axis=1) * qk_scale_log2)
            p = gl.exp2(s * qk_scale_log2 - m_new[:, None])
            alpha = gl.exp2(m_i - m_new)
        l_i = l_i * alpha + gl.sum(p, axis=1)
        return p, m_new, l_i, alpha

    @gluon.jit
    def _tile_softmax(s, m_i, l_i, qk_scale_log2, j, n_full, offs_n, rows, k_len, diag, IS_CAUSAL: gl.constexpr,
                      BLOCK_N: gl.constexpr):
        """_softmax of key tile j: its mask is needed from tile n_full on."""
        if j < n_full:
            p32, m_i, l_i, alpha = _softmax(s, m_i, l_i, qk_scale_log2, j * BLOCK_N + offs_n, rows, k_len, diag,
                                            False, IS_CAUSAL)
        else:
            p32, m_i, l_i, alpha = _softmax(s, m_i, l_i, qk_scale_log2, j * BLOCK_N + offs_n, rows, k_len, diag,
                                            True, IS_CAUSAL)
        return p32, m_i, l_i, alpha

    @gluon.jit
    def _consumer(args, WG: gl.constexpr, IS_CAUSAL: gl.constexpr, RETURN_LSE: gl.constexpr, PAGE: gl.constexpr,
                  OVERLAP: gl.constexpr):
        """One warpgroup: rows [m_start + 64 WG, +64) of this program, every key tile they see.
        PAGE > 0 (paged K/V): the rows of the last tile past the context are cache slots of
        the last page (or the last page again), maybe NaN: they are zeroed in V before P V.
        OVERLAP False (ablation only): each tile's Q K^T, softmax and P V in turn, every wgmma
        waited for at once."""
        (descs, k_smem, v_smem, q_smem, q_bar, k_ready, k_empty, v_ready, v_empty,
         o_base, stride_om, lse_base, stride_lm, q_len, k_len, m_start, qk_scale_log2,
         q_row, q_col, table_row, kv_col) = args
        q_desc, _, _ = descs
        STAGES: gl.constexpr = k_smem.type.shape[0]
        BLOCK_N: gl.constexpr = k_smem.type.shape[1]
        HEAD_DIM: gl.constexpr = k_smem.type.shape[2]
        dtype: gl.constexpr = k_smem.dtype
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, BLOCK_N, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, HEAD_DIM, 16])
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
        row_o: gl.constexpr = gl.SliceLayout(1, o_layout)

        rows0 = m_start + WG * 64
        n_tiles, n_full = _key_tiles(q_len, k_len, rows0, IS_CAUSAL, BLOCK_N)
        n_other, _ = _key_tiles(q_len, k_len, m_start + (1 - WG) * 64, IS_CAUSAL, BLOCK_N)
        n_loaded = gl.maximum(n_tiles, n_other)
        diag = k_len - q_len
        rows = rows0 + gl.arange(0, 64, layout=row_s)
        offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))

        q_tile = q_smem.index(WG)
        mbarrier.expect(q_bar.index(WG), q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [q_row + rows0, q_col], q_bar.index(WG), q_tile)

        m_i = gl.full([64], float("-inf"), gl.float32, layout=row_s)
        l_i = gl.zeros([64], gl.float32, layout=row_s)
        acc = gl.zeros([64, HEAD_DIM], gl.float32, layout=o_layout)
        s_zero = gl.zeros([64, BLOCK_N], gl.float32, layout=s_layout)
        p = gl.convert_layout(gl.zeros([64, BLOCK_N], dtype, layout=s_layout), p_layout)
        mbarrier.wait(q_bar.index(WG), 0)

        if OVERLAP:
            # Tile 0: its scores alone (nothing to overlap with yet).
            if n_tiles > 0:
                mbarrier.wait(k_ready.index(0), 0)
                s_tok = warpgroup_mma(q_tile, k_smem.index(0).permute((1, 0)), s_zero, use_acc=False, is_async=True)
                s = warpgroup_mma_wait(0, deps=[s_tok])
                mbarrier.arrive(k_empty.index(0))
                p32, m_i, l_i, alpha = _tile_softmax(s, m_i, l_i, qk_scale_log2, 0, n_full, offs_n, rows, k_len,
                                                     diag, IS_CAUSAL, BLOCK_N)
                p = gl.convert_layout(p32.to(dtype), p_layout)

            # Tile j: issue S_j = Q K_j^T, then O += P_{j-1} V_{j-1}; softmax S_j while P V runs.
            for j in range(1, n_tiles):
                st = j % STAGES
                prev = (j - 1) % STAGES
                mbarrier.wait(k_ready.index(st), (j // STAGES) & 1)
                s_tok = warpgroup_mma(q_tile, k_smem.index(st).permute((1, 0)), s_zero, use_acc=False, is_async=True)
                mbarrier.wait(v_ready.index(prev), ((j - 1) // STAGES) & 1)
                o_tok = warpgroup_mma(p, v_smem.index(prev), acc, is_async=True)
                s = warpgroup_mma_wait(1, deps=[s_tok])
                mbarrier.arrive(k_empty.index(st))
                p32, m_i, l_i, alpha = _tile_softmax(s, m_i, l_i, qk_scale_log2, j, n_full, offs_n, rows, k_len,
                                                     diag, IS_CAUSAL, BLOCK_N)
                acc = warpgroup_mma_wait(0, deps=[o_tok])
                mbarrier.arrive(v_empty.index(prev))
                acc = acc * gl.convert_layout(alpha, row_o)[:, None]
                p = gl.convert_layout(p32.to(dtype), p_layout)

            if n_tiles > 0:
                last = (n_tiles - 1) % STAGES
                mbarrier.wait(v_ready.index(last), ((n_tiles - 1) // STAGES) & 1)
                if PAGE > 0:
                    if n_tiles * BLOCK_N > k_len:
                        # both warpgroups may rewrite these rows, with the same values
                        _zero_rows_from(v_smem.index(last), k_len - (n_tiles - 1) * BLOCK_N)
                o_tok = warpgroup_mma(p, v_smem.index(last), acc, is_async=True)
                acc = warpgroup_mma_wait(0, deps=[o_tok])
                mbarrier.arrive(v_empty.index(last))
        else:
            for j in range(n_tiles):
                st = j % STAGES
                ph = (j // STAGES) & 1
                mbarrier.wait(k_ready.index(st), ph)
                s_tok = warpgroup_mma(q_tile, k_smem.index(st).permute((1, 0)), s_zero, use_acc=False, is_async=True)
                s = warpgroup_mma_wait(0, deps=[s_tok])
                mbarrier.arrive(k_empty.index(st))
                p32, m_i, l_i, alpha = _tile_softmax(s, m_i, l_i, qk_scale_log2, j, n_full, offs_n, rows, k_len,
                                                     diag, IS_CAUSAL, BLOCK_N)
                acc = acc * gl.convert_layout(alpha, row_o)[:, None]
                p = gl.convert_layout(p32.to(dtype), p_layout)
                mbarrier.wait(v_ready.index(st), ph)
                if PAGE > 0:
                    if (j == n_tiles - 1) & (n_tiles * BLOCK_N > k_len):
                        _zero_rows_from(v_smem.index(st), k_len - j * BLOCK_N)
                o_tok = warpgroup_mma(p, v_smem.index(st), acc, is_async=True)
                acc = warpgroup_mma_wait(0, deps=[o_tok])
                mbarrier.arrive(v_empty.index(st))

        # Tiles only the other warpgroup sees: release them so the loader's rings turn.
        for j in range(n_tiles, n_loaded):
            st = j % STAGES
            ph = (j // STAGES) & 1
            mbarrier.wait(k_ready.index(st), ph)
            mbarrier.arrive(k_empty.index(st))
            mbarrier.wait(v_ready.index(st), ph)
            mbarrier.arrive(v_empty.index(st))

        # Rows that saw no key have l == 0 and acc == 0: they store exact zeros.
        l_o = gl.convert_layout(l_i, row_o)
        l_safe = gl.where(l_o == 0.0, 1.0, l_o)
        out = (acc / l_safe[:, None]).to(dtype)
        rows_o = rows0 + gl.arange(0, 64, layout=row_o)
        offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
        # 64-bit row offsets formed per row, before the broadcast to [64, D] (the 2-D int64
        # form with a mask does not lower under triton 3.6)
        row_ptr = o_base + rows_o.to(gl.int64) * stride_om
        gl.store(row_ptr[:, None] + offs_d[None, :], out, mask=rows_o[:, None] < q_len)
        if RETURN_LSE:
            lse = gl.where(l_i == 0.0, float("-inf"), (m_i + gl.log2(gl.where(l_i == 0.0, 1.0, l_i)))
                           * 0.6931471805599453)
            gl.store(lse_base + rows.to(gl.int64) * stride_lm, lse, mask=rows < q_len)

    @gluon.jit
    def _zero_rows_from(tile, first):
        """Rows [first, BLOCK_N) of a [BLOCK_N, D] shared tile set to zero, visible to wgmma."""
        BLOCK_N: gl.constexpr = tile.type.shape[0]
        layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        vals = tile.load(layout)
        rows = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, layout))
        tile.store(gl.where(rows[:, None] < first, vals, gl.zeros_like(vals)))
        fence_async_shared()
        gl.thread_barrier()

    @gluon.jit
    def _consumer0(args, IS_CAUSAL: gl.constexpr, RETURN_LSE: gl.constexpr, PAGE: gl.constexpr,
                   TABLE_AHEAD: gl.constexpr, SPLIT_LOADER: gl.constexpr, OVERLAP: gl.constexpr):
        _consumer(args, 0, IS_CAUSAL, RETURN_LSE, PAGE, OVERLAP)

    @gluon.jit
    def _consumer1(args, IS_CAUSAL: gl.constexpr, RETURN_LSE: gl.constexpr, PAGE: gl.constexpr,
                   TABLE_AHEAD: gl.constexpr, SPLIT_LOADER: gl.constexpr, OVERLAP: gl.constexpr):
        _consumer(args, 1, IS_CAUSAL, RETURN_LSE, PAGE, OVERLAP)

    @gluon.jit
    def _tile_pages(table_row, last_page, key0, PAGE: gl.constexpr, BLOCK_N: gl.constexpr):
        """Cache blocks of the pages of the key tile at key0, clamped to the context's last page:
        one entry, or (PAGE < BLOCK_N) the tile's BLOCK_N / PAGE entries held whole by every
        lane, so that _pick_page is a select in registers, not a shuffle across the warp."""
        if PAGE >= BLOCK_N:
            return gl.load(table_row + gl.minimum(key0 // PAGE, last_page))
        else:
            layout: gl.constexpr = gl.BlockedLayout([BLOCK_N // PAGE], [32], [1], [0])
            c = gl.arange(0, BLOCK_N // PAGE, layout=layout)
            return gl.load(table_row + gl.minimum(key0 // PAGE + c, last_page))

    @gluon.jit
    def _pick_page(pages, i: gl.constexpr):
        c = gl.arange(0, pages.type.shape[0], layout=pages.type.layout)
        return gl.sum(gl.where(c == i, pages, 0), axis=0)

    @gluon.jit
    def _load_tile(desc, pages, key0, kv_col, bar, dst, PAGE: gl.constexpr, TABLE_AHEAD: gl.constexpr, table_row,
                   last_page):
        """The BLOCK_N keys from key0 into dst: one TMA box when the keys are contiguous
        (PAGE 0: a dense sequence; PAGE >= BLOCK_N: one page), else one box per page, from
        the tile's blocks in `pages` (_tile_pages)."""
        BLOCK_N: gl.constexpr = dst.type.shape[0]
        if PAGE == 0:
            tma.async_copy_global_to_shared(desc, [key0, kv_col], bar, dst)
        else:
            COPIES: gl.constexpr = (BLOCK_N + PAGE - 1) // PAGE
            for i in gl.static_range(COPIES):
                if not TABLE_AHEAD:
                    block = gl.load(table_row + gl.minimum(key0 // PAGE + i, last_page))
                elif PAGE >= BLOCK_N:
                    block = pages
                else:
                    block = _pick_page(pages, i)
                if PAGE >= BLOCK_N:
                    tma.async_copy_global_to_shared(desc, [block * PAGE + key0 % PAGE, kv_col], bar, dst)
                else:
                    tma.async_copy_global_to_shared(desc, [block * PAGE, kv_col], bar, dst.slice(i * PAGE, PAGE))

    @gluon.jit
    def _fill_slot(desc, empty, ready, dst, phase, pages, key0, kv_col, PAGE: gl.constexpr, TABLE_AHEAD: gl.constexpr,
                   table_row, last_page):
        """Wait until both consumers released ring slot `dst` (phase), then copy the key tile at
        key0 into it, completing on `ready`."""
        tile_bytes: gl.constexpr = dst.type.shape[0] * dst.type.shape[1] * dst.dtype.primitive_bitwidth // 8
        mbarrier.wait(empty, phase)
        mbarrier.expect(ready, tile_bytes)
        _load_tile(desc, pages, key0, kv_col, ready, dst, PAGE, TABLE_AHEAD, table_row, last_page)

    @gluon.jit
    def _loader_rings(args, DO_K: gl.constexpr, DO_V: gl.constexpr, PAGE: gl.constexpr,
                      TABLE_AHEAD: gl.constexpr, IS_CAUSAL: gl.constexpr):
        """K tiles (DO_K) and / or V tiles (DO_V) of every key tile either warpgroup sees, into
        their rings. Paged (PAGE > 0): page indices are clamped to the last page the context
        uses, so table entries past it are never read; TABLE_AHEAD, a tile's entries are read
        once, a tile ahead (the next tile's are requested before the wait for a ring slot)."""
        (descs, k_smem, v_smem, q_smem, q_bar, k_ready, k_empty, v_ready, v_empty,
         o_base, stride_om, lse_base, stride_lm, q_len, k_len, m_start, qk_scale_log2,
         q_row, q_col, table_row, kv_col) = args
        _, k_desc, v_desc = descs
        STAGES: gl.constexpr = k_smem.type.shape[0]
        BLOCK_N: gl.constexpr = k_smem.type.shape[1]
        pages = 0
        last_page = 0
        if PAGE > 0:
            last_page = gl.maximum(gl.cdiv(k_len, PAGE) - 1, 0)
            if TABLE_AHEAD:
                pages = _tile_pages(table_row, last_page, 0, PAGE, BLOCK_N)
        n0, _ = _key_tiles(q_len, k_len, m_start, IS_CAUSAL, BLOCK_N)
        n1, _ = _key_tiles(q_len, k_len, m_start + 64, IS_CAUSAL, BLOCK_N)
        for j in range(gl.maximum(n0, n1)):
            st = j % STAGES
            # a fresh barrier counts as having completed the phase before its first: the
            # first STAGES waits pass at once
            ph = ((j // STAGES) & 1) ^ 1
            if DO_K:
                _fill_slot(k_desc, k_empty.index(st), k_ready.index(st), k_smem.index(st), ph, pages, j * BLOCK_N,
                           kv_col, PAGE, TABLE_AHEAD, table_row, last_page)
            next_pages = pages
            if PAGE > 0:
                if TABLE_AHEAD:
                    next_pages = _tile_pages(table_row, last_page, (j + 1) * BLOCK_N, PAGE, BLOCK_N)
            if DO_V:
                _fill_slot(v_desc, v_empty.index(st), v_ready.index(st), v_smem.index(st), ph, pages, j * BLOCK_N,
                           kv_col, PAGE, TABLE_AHEAD, table_row, last_page)
            pages = next_pages

    @gluon.jit
    def _loader(args, IS_CAUSAL: gl.constexpr, RETURN_LSE: gl.constexpr, PAGE: gl.constexpr,
                TABLE_AHEAD: gl.constexpr, SPLIT_LOADER: gl.constexpr, OVERLAP: gl.constexpr):
        """One warp loading K and V (or, SPLIT_LOADER, K only)."""
        _loader_rings(args, True, not SPLIT_LOADER, PAGE, TABLE_AHEAD, IS_CAUSAL)

    @gluon.jit
    def _loader_v(args, IS_CAUSAL: gl.constexpr, RETURN_LSE: gl.constexpr, PAGE: gl.constexpr,
                  TABLE_AHEAD: gl.constexpr, SPLIT_LOADER: gl.constexpr, OVERLAP: gl.constexpr):
        """SPLIT_LOADER: a second warp loading V, so each warp issues half the page copies."""
        _loader_rings(args, False, True, PAGE, TABLE_AHEAD, IS_CAUSAL)

    @gluon.jit
    def _run(q_desc, k_desc, v_desc, o_base, stride_om, lse_base, stride_lm, q_len, k_len, m_start,
             qk_scale_log2, q_row, q_col, table_row, kv_col, IS_CAUSAL: gl.constexpr, RETURN_LSE: gl.constexpr,
             PAGE: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, LOADER_REGS: gl.constexpr,
             CONSUMER_REGS: gl.constexpr, TABLE_AHEAD: gl.constexpr, SPLIT_LOADER: gl.constexpr,
             OVERLAP: gl.constexpr):
        """Shared memory, barriers and the three partitions of one program (dense or paged)."""
        dtype: gl.constexpr = q_desc.dtype
        HEAD_DIM: gl.constexpr = q_desc.block_type.shape[1]
        smem_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        q_smem = gl.allocate_shared_memory(dtype, [2, 64, HEAD_DIM], smem_layout)
        k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], smem_layout)
        v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], smem_layout)
        bar_layout: gl.constexpr = mbarrier.MBarrierLayout()
        q_bar = gl.allocate_shared_memory(gl.int64, [2, 1], bar_layout)
        k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar_layout)
        k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar_layout)
        v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar_layout)
        v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar_layout)
        for i in gl.static_range(2):
            mbarrier.init(q_bar.index(i), count=1)
        for i in gl.static_range(STAGES):
            mbarrier.init(k_ready.index(i), count=1)
            mbarrier.init(v_ready.index(i), count=1)
            mbarrier.init(k_empty.index(i), count=2)  # one arrival per consumer warpgroup
            mbarrier.init(v_empty.index(i), count=2)
        # every partition takes the same arguments (worker partitions must share one signature);
        # constexprs go as their own arguments: inside a tuple they would become run-time flags
        args = ((q_desc, k_desc, v_desc), k_smem, v_smem, q_smem, q_bar, k_ready, k_empty, v_ready, v_empty,
                o_base, stride_om, lse_base, stride_lm, q_len, k_len, m_start, qk_scale_log2,
                q_row, q_col, table_row, kv_col)
        # the partition list is spelt out twice: the Gluon front end cannot hold the partition
        # functions in a list built up in jit code
        if SPLIT_LOADER:
            gl.warp_specialize([
                (_consumer0, (args, IS_CAUSAL, RETURN_LSE, PAGE, TABLE_AHEAD, SPLIT_LOADER, OVERLAP)),
                (_consumer1, (args, IS_CAUSAL, RETURN_LSE, PAGE, TABLE_AHEAD, SPLIT_LOADER, OVERLAP)),
                (_loader, (args, IS_CAUSAL, RETURN_LSE, PAGE, TABLE_AHEAD, SPLIT_LOADER, OVERLAP)),
                (_loader_v, (args, IS_CAUSAL, RETURN_LSE, PAGE, TABLE_AHEAD, SPLIT_LOADER, OVERLAP)),
            ], [4, 1, 1], [CONSUMER_REGS, LOADER_REGS, LOADER_REGS])
        else:
            gl.warp_specialize([
                (_consumer0, (args, IS_CAUSAL, RETURN_LSE, PAGE, TABLE_AHEAD, SPLIT_LOADER, OVERLAP)),
                (_consumer1, (args, IS_CAUSAL, RETURN_LSE, PAGE, TABLE_AHEAD, SPLIT_LOADER, OVERLAP)),
                (_loader, (args, IS_CAUSAL, RETURN_LSE, PAGE, TABLE_AHEAD, SPLIT_LOADER, OVERLAP)),
            ], [4, 1], [CONSUMER_REGS, LOADER_REGS])

    @gluon.jit
    def _attn_fwd_gluon(
        Q, K, V, O, LSE,
        cu_seqlens_q, cu_seqlens_k,
        seqlen_q, seqlen_k,
        stride_qb, stride_qh, stride_qm,
        stride_kb, stride_kh, stride_kn,
        stride_vb, stride_vh, stride_vn,
        stride_ob, stride_oh, stride_om,
        stride_lb, stride_lh, stride_lm,
        num_q_heads, kv_group,
        qk_scale_log2,
        IS_VARLEN: gl.constexpr,
        IS_CAUSAL: gl.constexpr,
        HEAD_DIM: gl.constexpr,
        BLOCK_N: gl.constexpr,
        STAGES: gl.constexpr,
        RETURN_LSE: gl.constexpr,
        LOADER_REGS: gl.constexpr,
        CONSUMER_REGS: gl.constexpr,
        OVERLAP: gl.constexpr,
        section_hb,
        L2_SECTIONS: gl.constexpr,
    ):
        # the same (sequence, head, query tile) per program and row bases as the pointer kernel;
        # L2_SECTIONS: the programs in launch order walk the (sequence, head) pairs in sections of
        # section_hb (whole GQA groups), a section's tiles before the next section's
        if L2_SECTIONS:
            pid_bh, pid_m = _section_item(section_hb)
            seq, head, kv_head, pid_m, q_start, q_len, k_start, k_len = _rows_of(
                pid_bh, pid_m, cu_seqlens_q, cu_seqlens_k, seqlen_q, seqlen_k, num_q_heads, kv_group, IS_VARLEN)
        else:
            seq, head, kv_head, pid_m, q_start, q_len, k_start, k_len = _program_rows(
                cu_seqlens_q, cu_seqlens_k, seqlen_q, seqlen_k, num_q_heads, kv_group, IS_VARLEN)
        m_start = pid_m * 128
        # a program past its sequence's rows (varlen grids are sized by the longest) exits before
        # building descriptors or forking partitions
        if m_start < q_len:
            seq64 = seq.to(gl.int64)
            q_base, k_base, v_base, o_base = _head_bases(Q, K, V, O, seq64, head, kv_head, q_start, k_start,
                                                         stride_qb, stride_qh, stride_qm, stride_kb, stride_kh,
                                                         stride_kn, stride_vb, stride_vh, stride_vn, stride_ob,
                                                         stride_oh, stride_om)
            lse_base = LSE + seq64 * stride_lb + q_start * stride_lm + head.to(gl.int64) * stride_lh

            smem_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
            # a zero extent is not a valid TMA bound: empty ranges get one row that is never read
            q_desc = tma.make_tensor_descriptor(q_base, [gl.maximum(q_len, 1), HEAD_DIM], [stride_qm, 1],
                                                [64, HEAD_DIM], smem_layout)
            k_desc = tma.make_tensor_descriptor(k_base, [gl.maximum(k_len, 1), HEAD_DIM], [stride_kn, 1],
                                                [BLOCK_N, HEAD_DIM], smem_layout)
            v_desc = tma.make_tensor_descriptor(v_base, [gl.maximum(k_len, 1), HEAD_DIM], [stride_vn, 1],
                                                [BLOCK_N, HEAD_DIM], smem_layout)

            # PAGE 0: no block table (cu_seqlens_k only fills its pointer slot; it is never read)
            _run(q_desc, k_desc, v_desc, o_base, stride_om, lse_base, stride_lm, q_len, k_len, m_start,
                 qk_scale_log2, 0, 0, cu_seqlens_k, 0, IS_CAUSAL, RETURN_LSE, 0, BLOCK_N, STAGES,
                 LOADER_REGS, CONSUMER_REGS, True, False, OVERLAP)


    @gluon.jit
    def _section_item(section_hb):
        """(pair, query tile) of this program when the grid's pairs run in sections of section_hb:
        launch-order index w (axis 0 fastest) -> within its section, every pair's last (under
        causal the heaviest) tile first, pairs fastest."""
        num_pairs = gl.num_programs(0)
        m_blocks = gl.num_programs(1)
        w = gl.program_id(1) * num_pairs + gl.program_id(0)
        first = w // (section_hb * m_blocks) * section_hb
        size = gl.minimum(section_hb, num_pairs - first)
        within = w - first * m_blocks
        rank = within // size
        return first + within - rank * size, m_blocks - 1 - rank

    @gluon.jit
    def _slot_seq(cu_seqlens_q, num_seqs, slot, SEARCH: gl.constexpr):
        """The sequence owning `slot` of the compact block space, in which sequence s owns slots
        from cu[s] // 128 + s on (starts grow strictly with s): the last s whose start is at most
        slot, found with two vector loads of SEARCH starts (num_seqs <= SEARCH^2)."""
        layout: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
        k = gl.arange(0, SEARCH, layout=layout)
        step = gl.cdiv(num_seqs, SEARCH)
        s1 = k * step
        ok1 = s1 < num_seqs
        start1 = gl.load(cu_seqlens_q + s1, mask=ok1, other=0) // 128 + s1
        coarse = gl.sum((ok1 & (start1 <= slot)).to(gl.int32), axis=0) - 1
        s2 = coarse * step + k
        ok2 = (k < step) & (s2 < num_seqs)
        start2 = gl.load(cu_seqlens_q + s2, mask=ok2, other=0) // 128 + s2
        return coarse * step + gl.sum((ok2 & (start2 <= slot)).to(gl.int32), axis=0) - 1

    @_jit_unspecialised("num_seqs")  # as paged._paged_kernel's num_seqs
    def _paged_fwd_gluon(
        q_desc, k_desc, v_desc, O, LSE, block_tables, cu_seqlens_q, context_lens,
        stride_ot, stride_oh, stride_lt, stride_lh, stride_table,
        num_seqs, num_q_heads, kv_group, min_q,
        qk_scale_log2,
        COMPACT: gl.constexpr,
        SEARCH: gl.constexpr,
        IS_CAUSAL: gl.constexpr,
        PAGE: gl.constexpr,
        BLOCK_N: gl.constexpr,
        STAGES: gl.constexpr,
        RETURN_LSE: gl.constexpr,
        LOADER_REGS: gl.constexpr,
        CONSUMER_REGS: gl.constexpr,
        TABLE_AHEAD: gl.constexpr,
        SPLIT_LOADER: gl.constexpr,
        OVERLAP: gl.constexpr,
    ):
        """Long chunks over a paged cache: the new tokens of sequence s (q_len > min_q) attend
        to its context_lens[s] cached keys, bottom-right causal. Program (head, slot) owns 128
        query rows of one head: slot -> (sequence, block) directly (slot % S, slot // S) or,
        COMPACT, through a space of about Tq / 128 + S slots (a mixed batch's decode rows then
        cost no programs). Slots run backwards, so late blocks (the most keys) start first.
        Descriptors come from the host: q [Tq, Hq * D], K / V cache [blocks * PAGE, Hkv * D]
        (one box per page, or per tile for pages of a tile or more)."""
        HEAD_DIM: gl.constexpr = q_desc.block_type.shape[1]
        head = gl.program_id(0)
        slot = gl.num_programs(1) - 1 - gl.program_id(1)
        kv_head = head // kv_group
        if COMPACT:
            seq = _slot_seq(cu_seqlens_q, num_seqs, slot, SEARCH)
            q_start = gl.load(cu_seqlens_q + seq)
            m_start = (slot - q_start // 128 - seq) * 128
        else:
            seq = slot % num_seqs
            q_start = gl.load(cu_seqlens_q + seq)
            m_start = slot // num_seqs * 128
        q_len = gl.load(cu_seqlens_q + seq + 1) - q_start
        if (m_start < q_len) & (q_len > min_q):
            ctx = gl.load(context_lens + seq)
            o_base = O + q_start.to(gl.int64) * stride_ot + head.to(gl.int64) * stride_oh
            lse_base = LSE + q_start.to(gl.int64) * stride_lt + head.to(gl.int64) * stride_lh
            table_row = block_tables + seq.to(gl.int64) * stride_table
            _run(q_desc, k_desc, v_desc, o_base, stride_ot, lse_base, stride_lt, q_len, ctx, m_start,
                 qk_scale_log2, q_start, head * HEAD_DIM, table_row, kv_head * HEAD_DIM, IS_CAUSAL, RETURN_LSE,
                 PAGE, BLOCK_N, STAGES, LOADER_REGS, CONSUMER_REGS, TABLE_AHEAD, SPLIT_LOADER, OVERLAP)


# Registers: 4 + 4 + 1 (or + 1 + 1, split loader) warps round up to 12 (three warpgroups) at
# `maxnreg` each on launch; the loaders' warpgroup gives its registers to the consumers.
_MAXNREG = 168
_LOADER_REGS = 24
_CONSUMER_REGS = 240


def l2_section(num_seqs: int, num_q_heads: int, num_kv_heads: int, max_seqlen_k: int, total_keys: int,
               head_dim: int, l2_bytes: int) -> int:
    """(sequence, head) pairs per section of the sectioned program order: whole GQA groups whose
    K and V (max_seqlen_k 16-bit keys each) fit in half of l2_bytes, in sections of equal size;
    0 when all K/V (total_keys keys per KV head) fit in the L2 (the plain order then)."""
    group = num_q_heads // num_kv_heads
    kv_pairs = num_seqs * num_kv_heads
    per_kv_head = 2 * max_seqlen_k * head_dim * 2
    if l2_bytes <= 0 or 2 * total_keys * num_kv_heads * head_dim * 2 <= l2_bytes:
        return 0
    fit = max(1, l2_bytes // 2 // per_kv_head)
    sections = triton.cdiv(kv_pairs, fit)
    return triton.cdiv(kv_pairs, sections) * group


@functools.lru_cache(maxsize=None)
def _l2_bytes(device_index: int) -> int:
    return int(getattr(torch.cuda.get_device_properties(device_index), "L2_cache_size", 0))


def section_for(q: torch.Tensor, num_seqs: int, num_q_heads: int, num_kv_heads: int, max_seqlen_k: int,
                total_keys: int) -> int:
    """launch()'s section_hb for a call on q's device: l2_section when configs turns the
    sectioned order on, else 0."""
    from . import configs

    if not configs.gluon_l2_sections() or not q.is_cuda:
        return 0
    index = q.device.index if q.device.index is not None else torch.cuda.current_device()
    return l2_section(num_seqs, num_q_heads, num_kv_heads, max_seqlen_k, total_keys, q.shape[-1], _l2_bytes(index))


def launch(args: tuple, num_programs_bh: int, max_seqlen_q: int, is_varlen: bool, causal: bool,
           head_dim: int, return_lse: bool, block_n: int = 128, stages: int = 2, section_hb: int = 0) -> None:
    """Run _attn_fwd_gluon over prefill.dense_args / varlen_args. The caller checked
    usable(): 16-bit tensors with 16-byte aligned bases and strides, on an sm_90 GPU.
    section_hb > 0: the programs in L2 sections of that many (sequence, head) pairs (l2_section)."""
    from . import configs

    consumer_regs, loader_regs = configs.gluon_regs(_CONSUMER_REGS, _LOADER_REGS)
    grid = (num_programs_bh, triton.cdiv(max_seqlen_q, BLOCK_M))
    fast(_attn_fwd_gluon)[grid](
        *args,
        IS_VARLEN=is_varlen,
        IS_CAUSAL=causal,
        HEAD_DIM=head_dim,
        BLOCK_N=block_n,
        STAGES=stages,
        RETURN_LSE=return_lse,
        LOADER_REGS=loader_regs,
        CONSUMER_REGS=consumer_regs,
        OVERLAP=configs.gluon_overlap(),
        section_hb=section_hb,
        L2_SECTIONS=section_hb > 0,
        num_warps=4,
        maxnreg=_MAXNREG,
    )


def usable(q: torch.Tensor) -> bool:
    """Whether this kernel can run for q's device and dtype (the layout check is the TMA one)."""
    if not _HAVE_GLUON or not q.is_cuda or q.dtype not in (torch.float16, torch.bfloat16):
        return False
    if q.shape[-1] not in (64, 128):
        return False
    return torch.cuda.get_device_capability(q.device)[0] == 9


def paged_usable(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether launch_paged can serve these tensors: usable(q), 16-bit caches of q's dtype in the
    contiguous [blocks, page, Hkv, D] layout with pages of at least 16 tokens, and q [Tq, Hq, D]
    whose rows flatten to Hq * D (all 16-byte aligned, as TMA needs)."""
    if not usable(q) or k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        return False
    _, page, hkv, d = k_cache.shape
    want = (page * hkv * d, hkv * d, d, 1)
    if page < 16 or k_cache.stride() != want or v_cache.stride() != want:
        return False
    if q.stride(2) != 1 or q.stride(1) != d or (q.stride(0) * q.element_size()) % 16:
        return False
    return all(t.data_ptr() % 16 == 0 for t in (q, k_cache, v_cache))


@functools.lru_cache(maxsize=None)
def _layout():
    return gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)


# (dtype, device, shape, strides, block shape, 16-byte aligned base) -> a validated descriptor's
# fields but its base: an eager step builds three descriptors per layer, and Triton validates
# each one again though only the base tensor differs between calls of one shape
_descriptor_fields: dict = {}


def _descriptor(t: torch.Tensor, shape: list, strides: list, block_shape: list):
    """TensorDescriptor(t, shape, strides, block_shape, _layout()), validated once per key above."""
    key = (t.dtype, t.device, *shape, *strides, *block_shape, t.data_ptr() % 16 == 0)
    fields = _descriptor_fields.get(key)
    if fields is None:
        desc = TensorDescriptor(t, shape, strides, block_shape, _layout())
        if len(_descriptor_fields) >= 1024:
            _descriptor_fields.clear()
        # a descriptor class without __dict__ (another Triton) is built in full every time
        _descriptor_fields[key] = {k: v for k, v in vars(desc).items() if k != "base"} if hasattr(desc, "__dict__") \
            else False
        return desc
    if fields is False:
        return TensorDescriptor(t, shape, strides, block_shape, _layout())
    desc = object.__new__(TensorDescriptor)
    desc.__dict__.update(fields)
    desc.base = t
    return desc


def launch_paged(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 cu_seqlens_q: torch.Tensor, context_lens: torch.Tensor, out: torch.Tensor, lse_arg: torch.Tensor,
                 lse_strides: tuple, return_lse: bool, max_seqlen_q: int, min_q: int, causal: bool,
                 qk_scale_log2: float, search: int, block_n: int = 128, stages: int = 2,
                 table_ahead: bool | None = None, split_loader: bool | None = None) -> None:
    """_paged_fwd_gluon over sequences of more than min_q new tokens (paged_usable held;
    num_seqs <= search^2, search a power of two of at least 128):
    q / out [Tq, Hq, D], caches [blocks, page, Hkv, D], lse [Tq, Hq] float32 (lse_arg any
    tensor and lse_strides (0, 0) without it). table_ahead / split_loader None: configs'."""
    from . import configs

    if table_ahead is None:
        table_ahead = configs.gluon_table_ahead()
    if split_loader is None:
        split_loader = configs.gluon_split_loader()
    consumer_regs, loader_regs = configs.gluon_regs(_CONSUMER_REGS, _LOADER_REGS)
    total_q, num_q_heads, head_dim = q.shape
    num_blocks, page, num_kv_heads, _ = k_cache.shape
    box = min(page, block_n)
    q_desc = _descriptor(q, [total_q, num_q_heads * head_dim], [q.stride(0), 1], [64, head_dim])
    kv_shape = [num_blocks * page, num_kv_heads * head_dim]
    kv_strides = [num_kv_heads * head_dim, 1]
    k_desc = _descriptor(k_cache, kv_shape, kv_strides, [box, head_dim])
    v_desc = _descriptor(v_cache, kv_shape, kv_strides, [box, head_dim])
    num_seqs = cu_seqlens_q.shape[0] - 1
    direct = num_seqs * triton.cdiv(max_seqlen_q, BLOCK_M)
    compact = total_q // BLOCK_M + num_seqs
    grid = (num_q_heads, min(direct, compact))
    fast(_paged_fwd_gluon)[grid](
        q_desc, k_desc, v_desc, out, lse_arg, block_tables, cu_seqlens_q, context_lens,
        out.stride(0), out.stride(1), *lse_strides, block_tables.stride(0),
        num_seqs, num_q_heads, num_q_heads // num_kv_heads, min_q,
        qk_scale_log2,
        COMPACT=compact < direct,
        SEARCH=search,
        IS_CAUSAL=causal,
        PAGE=page,
        BLOCK_N=block_n,
        STAGES=stages,
        RETURN_LSE=return_lse,
        LOADER_REGS=loader_regs,
        CONSUMER_REGS=consumer_regs,
        TABLE_AHEAD=table_ahead,
        SPLIT_LOADER=split_loader,
        OVERLAP=configs.gluon_overlap(),
        num_warps=4,
        maxnreg=_MAXNREG,
    )
