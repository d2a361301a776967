"""Turns a StepPlan into packed tensors, runs the model, returns the logits to sample.

A step packs every chunk back to back ([T] tokens, no padding). Attention:
- a decode-only step feeds one token per sequence to the paged decode kernel;
  on CUDA it replays a captured CUDA graph of the whole decode forward (batch
  padded up to the next captured size: padded rows have context_len 0 and
  slot -1, so they read and write nothing);
- a step whose chunks all start at position 0 (fresh prompts, no cached
  prefix) runs the varlen prefill kernel over the fresh K/V;
- any other step (chunks over a cached prefix, prefix-cache hits, decodes
  mixed with chunks) runs one paged_attention call per layer over the cache;
- with a batch-invariant model every step is a paged step (decode steps with
  cu_seqlens 0, 1, ..., B), so every token goes through the same attention launch.
The runner is a function of the plan: it reads block tables from the cache and
changes no state (the scheduler updates the sequences afterwards).
"""

from __future__ import annotations

import logging

import torch

from .model import AttentionMetadata, Qwen3Model
from .scheduler import StepPlan
from .sequence import Sequence

log = logging.getLogger("minipaged.engine")


# On a GPU, block tables are padded to a multiple of this many columns (never read past a
# sequence's own pages): Triton specialises a kernel on whether its int arguments are 1 or
# divisible by 16, so a table row stride that tracked the batch's longest sequence would compile
# another variant of every attention kernel whenever it changed class, mid-serving. On the CPU
# (torch, or Triton's interpreter, which compiles nothing) the wider tables would only cost time.
TABLE_WIDTH_MULTIPLE = 16


def table_width(width: int, multiple: int = TABLE_WIDTH_MULTIPLE) -> int:
    return -(-max(width, 1) // multiple) * multiple


def _graph_batch_sizes(max_bs: int) -> list[int]:
    sizes = [1, 2, 4, 8] + list(range(16, max_bs + 1, 16))
    sizes = sorted({s for s in sizes if s <= max_bs} | {max_bs})
    return sizes


class ModelRunner:
    def __init__(self, model: Qwen3Model, cache, *, max_num_seqs: int, max_model_len: int,
                 use_cuda_graph: bool = False) -> None:
        self.model = model
        self.cache = cache
        self.device = model.device
        self.block_size = cache.block_size
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.max_blocks_per_seq = -(-max_model_len // self.block_size)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.graph_outputs: dict[int, torch.Tensor] = {}
        self.use_cuda_graph = bool(use_cuda_graph) and self.device.type == "cuda"
        self.table_multiple = TABLE_WIDTH_MULTIPLE if self.device.type == "cuda" else 1
        self.graph_error: str | None = None
        self._graphs_ready = False

    # (inference mode whoever calls: the graphs' static inputs are inference tensors, which may only be
    # written inside it)
    @torch.inference_mode()
    def run(self, plan: StepPlan, *, calibrate_kv: bool = False) -> torch.Tensor:
        """Logits [R, V] (fp32), one row per sampling chunk of `plan`, in plan order.
        calibrate_kv: an fp8 cache's scales are set from this step's K/V (a prompt step)."""
        if plan.decode_only:
            assert not calibrate_kv, "fp8 scales are calibrated on a prompt step"
            return self.decode([c.seq for c in plan.chunks])
        return self.forward_chunks(plan, calibrate_kv)

    # ------------------------------------------------------------------ chunks
    def forward_chunks(self, plan: StepPlan, calibrate_kv: bool = False) -> torch.Tensor:
        dev, bs = self.device, self.block_size
        ids: list[int] = []
        pos, slots, tables = [], [], []
        cu, ctx, last_rows = [0], [], []
        for c in plan.chunks:
            seq = c.seq
            ids.extend(seq.token_ids[c.start:c.end])
            table = self.cache.block_table(seq.seq_id)
            p = torch.arange(c.start, c.end)
            pos.append(p)
            slots.append(torch.tensor(table, dtype=torch.int64)[p // bs] * bs + p % bs)
            tables.append(table)
            cu.append(cu[-1] + c.num_tokens)
            ctx.append(c.end)
            if c.samples:
                last_rows.append(cu[-1] - 1)
        positions = torch.cat(pos).to(dev)
        slot_mapping = torch.cat(slots).to(dev)
        cu_seqlens = torch.tensor(cu, dtype=torch.int32, device=dev)
        max_q = max(c.num_tokens for c in plan.chunks)
        if all(c.start == 0 for c in plan.chunks) and not self.model.batch_invariant:
            meta = AttentionMetadata("prefill", slot_mapping, cu_seqlens=cu_seqlens, max_seqlen_q=max_q,
                                     calibrate_kv=calibrate_kv)
        else:
            meta = AttentionMetadata(
                "paged", slot_mapping, cu_seqlens=cu_seqlens, max_seqlen_q=max_q,
                block_tables=torch.tensor(self._padded_tables(tables), dtype=torch.int32, device=dev),
                context_lens=torch.tensor(ctx, dtype=torch.int32, device=dev), calibrate_kv=calibrate_kv)
        hidden = self.model.forward(torch.tensor(ids, dtype=torch.int64, device=dev), positions, meta, self.cache)
        if not last_rows:
            return hidden.new_empty((0, self.model.cfg.vocab_size), dtype=torch.float32)
        rows = torch.tensor(last_rows, dtype=torch.int64, device=dev)
        return self.model.logits(hidden[rows]).float()

    # ------------------------------------------------------------------ decode
    def _decode_inputs(self, seqs: list[Sequence]):
        bs = self.block_size
        ids, positions, slots, ctx, tables = [], [], [], [], []
        for s in seqs:
            p = s.num_computed
            table = self.cache.block_table(s.seq_id)
            ids.append(s.last_token)
            positions.append(p)
            slots.append(table[p // bs] * bs + p % bs)
            ctx.append(p + 1)
            tables.append(table)
        return ids, positions, slots, ctx, self._padded_tables(tables), max(len(t) for t in tables)

    def _padded_tables(self, tables: list[list[int]]) -> list[list[int]]:
        """The rows of a step's block table, -1 past each sequence's pages, as wide as the longest
        (rounded up to table_multiple columns)."""
        width = table_width(max(len(t) for t in tables), self.table_multiple)
        return [t + [-1] * (width - len(t)) for t in tables]

    def decode(self, seqs: list[Sequence]) -> torch.Tensor:
        """Logits [B, V] (fp32) for the next token of each sequence."""
        if self.use_cuda_graph and not self._graphs_ready and self.graph_error is None:
            self.capture_graphs()
        ids, positions, slots, ctx, tables, width = self._decode_inputs(seqs)
        B = len(seqs)
        if self.graphs_active and B <= self.max_num_seqs and width <= self.max_blocks_per_seq:
            logits = self._replay(B, ids, positions, slots, ctx, tables, width)
        else:
            dev = self.device
            meta = AttentionMetadata(
                "decode",
                torch.tensor(slots, dtype=torch.int64, device=dev),
                block_tables=torch.tensor(tables, dtype=torch.int32, device=dev),
                context_lens=torch.tensor(ctx, dtype=torch.int32, device=dev),
                cu_seqlens=torch.arange(B + 1, dtype=torch.int32, device=dev), max_seqlen_q=1,
            )
            hidden = self.model.forward(torch.tensor(ids, dtype=torch.int64, device=dev),
                                        torch.tensor(positions, dtype=torch.int64, device=dev),
                                        meta, self.cache)
            logits = self.model.logits(hidden)
        return logits.float()

    # ------------------------------------------------------------------ CUDA graphs
    @property
    def graphs_active(self) -> bool:
        """Decode replays captured graphs (use_cuda_graph may be switched off to compare)."""
        return self.use_cuda_graph and self._graphs_ready

    def _alloc_static(self) -> None:
        dev, n, w = self.device, self.max_num_seqs, table_width(self.max_blocks_per_seq, self.table_multiple)
        self.s_ids = torch.zeros(n, dtype=torch.int64, device=dev)
        self.s_pos = torch.zeros(n, dtype=torch.int64, device=dev)
        self.s_slots = torch.full((n,), -1, dtype=torch.int64, device=dev)
        self.s_ctx = torch.zeros(n, dtype=torch.int32, device=dev)
        self.s_tables = torch.zeros((n, w), dtype=torch.int32, device=dev)
        self.s_cu = torch.arange(n + 1, dtype=torch.int32, device=dev)  # one query per sequence

    def _graph_forward(self, b: int) -> torch.Tensor:
        meta = AttentionMetadata("decode", self.s_slots[:b], block_tables=self.s_tables[:b],
                                 context_lens=self.s_ctx[:b], cu_seqlens=self.s_cu[:b + 1], max_seqlen_q=1)
        hidden = self.model.forward(self.s_ids[:b], self.s_pos[:b], meta, self.cache)
        return self.model.logits(hidden)

    @torch.inference_mode()
    def capture_graphs(self) -> None:
        """Capture one decode graph per padded batch size. A failed capture is tried once more, then
        decode runs eagerly (graph_error says why). The retry is for failures that do not repeat: a
        Triton compile in the warm-up failed once mid-process and passed on every re-run
        (bench/results/nvidia-h100/gpu_tests_92e4b39/)."""
        for attempt in (1, 2):
            try:
                self._capture_all()
                self._graphs_ready = True
                return
            except Exception as exc:  # noqa: BLE001 - any capture problem means: retry, then run eagerly
                self.graphs.clear()
                self.graph_outputs.clear()
                self._graphs_ready = False
                error = f"{type(exc).__name__}: {exc}"
                try:
                    torch.cuda.synchronize(self.device)
                except Exception:  # noqa: BLE001
                    pass
                if attempt == 1:
                    log.warning("CUDA graph capture failed, trying once more: %s", error)
                else:
                    self.graph_error = error
                    log.warning("CUDA graph capture failed again, decoding eagerly: %s", error)

    def _capture_all(self) -> None:
        self._alloc_static()
        pool = None
        stream = torch.cuda.Stream(device=self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        # Padded rows must read nothing and write nothing.
        self.s_ctx.zero_()
        self.s_slots.fill_(-1)
        for b in reversed(_graph_batch_sizes(self.max_num_seqs)):
            with torch.cuda.stream(stream):
                self._graph_forward(b)  # warm-up: Triton JIT / CUDA build happen here, not in capture
            torch.cuda.current_stream(self.device).wait_stream(stream)
            torch.cuda.synchronize(self.device)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool):
                out = self._graph_forward(b)
            if pool is None:
                pool = g.pool()
            self.graphs[b] = g
            self.graph_outputs[b] = out
        torch.cuda.synchronize(self.device)

    def _replay(self, B, ids, positions, slots, ctx, tables, width) -> torch.Tensor:
        b = next(s for s in sorted(self.graphs) if s >= B)
        pad = b - B
        host = torch.tensor([ids + [0] * pad, positions + [0] * pad, slots + [-1] * pad], dtype=torch.int64)
        self.s_ids[:b].copy_(host[0], non_blocking=True)
        self.s_pos[:b].copy_(host[1], non_blocking=True)
        self.s_slots[:b].copy_(host[2], non_blocking=True)
        self.s_ctx[:b].copy_(torch.tensor(ctx + [0] * pad, dtype=torch.int32), non_blocking=True)
        # Columns past each row's own pages are never read (context_lens bounds the reads).
        self.s_tables[:B, :len(tables[0])].copy_(torch.tensor(tables, dtype=torch.int32), non_blocking=True)
        self.graphs[b].replay()
        return self.graph_outputs[b][:B]
