"""DeepSeek-V4 attention: shared latent KV, per-head sinks, sliding window, compressed entries.

Per layer (paper §2.3; transformers ``DeepseekV4Attention``), for this rank's ``n_r`` heads:

==============================  ==========================  ========================================
step                            weights (rank-local)        parallel style
==============================  ==========================  ========================================
``q_lora = q_norm(wq_a x)``     ``wq_a [q_lora, D]``        replicated
``q = rms(wq_b q_lora)``, RoPE  ``wq_b [n_r*d, q_lora]``    column-parallel, whole heads
``kv = kv_norm(wkv x)``, RoPE   ``wkv [d, D]``              replicated: one KV head, K = V
keys: window + compressed       compressor / indexer        replicated
softmax with ``attn_sink``      ``attn_sink [n_r]``         by head
inverse RoPE on the output      --                          --
grouped ``wo_a``                ``[G_r*o_lora, n*d/G]``     column-parallel, whole output groups
``wo_b``                        ``[D, G_r*o_lora]``         row-parallel: the layer's all-reduce
==============================  ==========================  ========================================

A query at position ``t`` sees window keys at ``t - window < s <= t`` and the compressed entries
its layer allows (HCA: every complete window; CSA: the indexer's top-k of them). RoPE rotates the
trailing ``rope_dim`` channels (sliding layers: plain RoPE at ``rope_theta``; compressed layers:
YaRN at ``compress_rope_theta``); as K = V, the output's rope channels are rotated back by the
query's angle. A prefill chunk attends through :func:`~shardsmith.runtime.layers.kernels.deepseek_v4.prefill_attention.prefill_attention`
(on CUDA one Triton launch that reads only the keys each query sees: its window rows, then its layer's
entries, on CSA layers the indexer's top-k gathered; its reference, float32 einsums over chunks of
queries, on CPU).

The state is kept per **slot** (one independent sequence each, preallocated by
:meth:`Attention.allocate`): a window ring per slot and the compressors' per-slot state. A prefill
(or chunk) of one sequence runs :meth:`Attention.core` on its slot; a batched decode step (``B``
rows, one token of a different slot each, or a slot's speculative verify run of consecutive tokens,
its ring then ``K - 1`` rows longer: :meth:`Attention.allocate`) runs :meth:`Attention.decode_core`, which attends all rows
at once over their own slot's window and entries, padded to the step's length bucket and masked, from
the layer's key buffer ``[sink | window | entries]`` with an additive bias (on CUDA two Triton launches
that read each key row once, :func:`~shardsmith.runtime.layers.kernels.deepseek_v4.sink_attention.sink_attention`;
its reference, one gather, a ``baddbmm``, a softmax and a ``bmm``, on CPU), the step's masks and
indices built once per step (:class:`DecodeRows`), and the compressors' and indexer's row-wise
projections done in :meth:`Attention.project`. The core is
device-only with shapes fixed by the rows and the length bucket, so a whole decode step can be
captured in one CUDA graph (padding rows use the model's scratch slot).

Legend: T = new tokens, B = decode rows, N = slots, D = hidden, n = local heads, d = head dim,
S = window keys, C = compressed entries, G = local output groups, o = o_lora_rank.
"""

from __future__ import annotations


import torch
import torch.nn.functional as F
from torch import nn

from shardsmith.runtime.layers.kernels.fp8_linear import fp8_linear
from shardsmith.runtime.layers.kernels.deepseek_v4.indexer_scores import indexer_scores
from shardsmith.runtime.layers.kernels.deepseek_v4.prefill_attention import prefill_attention
from shardsmith.runtime.layers.kernels.deepseek_v4.sink_attention import sink_attention
from shardsmith import settings
from shardsmith.errors import UsageError
from shardsmith.runtime.layers.fused import for_chunks
from shardsmith.runtime.layers.parallel import ReplicatedLinear, Shards, kernel_on, merge_rows
from shardsmith.runtime.models.deepseek_v4.compressor import Compressor, Indexer
from shardsmith.runtime.models.deepseek_v4.config import V4Args
from shardsmith.runtime.models.common import RMSNormF32
from shardsmith.runtime.models.deepseek_v4.ops import apply_rope, rms_unweighted, rope_cos_sin
from shardsmith.runtime.models.deepseek_v4.rows import DecodeRows, RowsSpec


class Attention(nn.Module):
    """One layer's attention on this rank, with every slot's sliding-window ring and compressor state.

    Args:
        args: model configuration; shards: the rank's plan; prefix: ``layers.N.attn``; layer: N;
        freqs_main / freqs_compress: RoPE inverse frequencies ``[rope_dim/2]``.
    """

    def __init__(self, args: V4Args, shards: Shards, prefix: str, layer: int, *,
                 freqs_main: torch.Tensor, freqs_compress: torch.Tensor) -> None:
        super().__init__()
        self.kind, self.window, self.head_dim, self.eps = args.kinds[layer], args.window, args.head_dim, args.norm_eps
        self.o_rank = args.o_lora_rank
        self.wq_a = shards.linear(prefix + ".wq_a")
        self.q_norm = RMSNormF32(args.q_lora_rank, args.norm_eps)
        self.wq_b = shards.linear(prefix + ".wq_b")
        self.wkv = shards.linear(prefix + ".wkv")
        self.kv_norm = RMSNormF32(args.head_dim, args.norm_eps)
        self.wo_a = shards.linear(prefix + ".wo_a")
        self.wo_b = shards.linear(prefix + ".wo_b")
        (self.n_heads,) = shards.tensor(prefix + ".attn_sink").local_shape(shards.rank)
        self.register_buffer("attn_sink", torch.empty(self.n_heads, dtype=torch.float32, device="meta"))
        self.table = "main" if self.kind == "sliding" else "compress"  # this layer's RoPE table (RowsSpec.freqs)
        self.freqs = freqs_main if self.kind == "sliding" else freqs_compress
        ratio = args.ratios[layer]
        self.compressor = self.indexer = None
        if self.kind != "sliding":
            self.compressor = Compressor(shards, prefix + ".compressor", ratio=ratio, dim=args.head_dim,
                                         overlap=self.kind == "csa", freqs=freqs_compress, eps=args.norm_eps)
        if self.kind == "csa":
            self.indexer = Indexer(shards, prefix + ".indexer", ratio=ratio, heads=args.index_heads,
                                   head_dim=args.index_head_dim, topk=args.index_topk, freqs=freqs_compress,
                                   eps=args.norm_eps)
        self.ratio = ratio
        self.keys = self.win = None  # set by allocate
        self.ring = self.window  # R: the window ring's rows (allocate)
        self._saved: tuple | None = None  # (slot, ring rows, their values): save() for rewind()
        self.max_seq_len = 0
        self.kernel = self.index_kernel = False  # decode attention / index scores through Triton (use_kernel_)
        self.prefill_kernel = False  # prefill attention and index scores through Triton (use_kernel_)
        self.x_fp8 = self.x_dense = None  # merged projections of x (fuse_projections_)

    def allocate(self, num_slots: int, max_seq_len: int, device: torch.device, dtype: torch.dtype, *,
                 runs: int = 1) -> None:
        """Preallocate every slot's state in ``dtype``: the key buffer ``keys`` ``[N, 1 + R + E, d]``
        (keys = values, RoPE applied), laid out as a decode step attends over it:

        =========================  =================  ==============================================
        rows                       view               what
        =========================  =================  ==============================================
        ``0``                      --                 the sink: zeros, never written (its logit is
                                                      the bias ``attn_sink``; its value adds 0)
        ``1 .. R``                 ``win [N, R, d]``  the window ring: position ``p`` at ``p % R``
        ``1 + R ..``               compressor's       ``E = max_seq_len // ratio`` compressed entries
                                   ``entries``        (compressed layers; ``E = 0`` on sliding ones)
        =========================  =================  ==============================================

        so a step's keys of every row are one gather, ``keys[slots, :1 + R + C]``; the compressors'
        other state is theirs (:meth:`Compressor.allocate`). :meth:`state` lists the views (the
        sink row is not state). ``runs`` (K): the most rows one slot may have in a decode step (a
        speculative verify run); the ring then holds ``R = W + K - 1`` rows (:class:`RowsSpec`)."""
        d = self.head_dim
        R = self.ring = self.window + runs - 1
        self.max_seq_len = max_seq_len
        E = max_seq_len // self.ratio if self.compressor is not None else 0
        self.keys = torch.zeros(num_slots, 1 + R + E, d, device=device, dtype=dtype)
        self.win = self.keys[:, 1:1 + R]
        if self.compressor is not None:
            self.compressor.allocate(num_slots, max_seq_len, device, dtype, entries=self.keys[:, 1 + R:])
        if self.indexer is not None:
            self.indexer.compressor.allocate(num_slots, max_seq_len, device, dtype)

    def fuse_projections_(self) -> None:
        """Merge the projections of the layer input ``x`` that share a format into one weight each, so a
        decode step reads each group in one launch (on the kernel path, CUDA; once the weights are final:
        the model's ``setup_cache``):

        ===========  =====================================================  ===========================
        group        weights, in order (rows concatenated)                  when
        ===========  =====================================================  ===========================
        ``x_fp8``    ``wq_a [q_lora, D] | wkv [d, D]`` and their scales     both kernel FP8 linears,
                                                                            rows in whole scale blocks
        ``x_dense``  ``compressor.wkv | .wgate`` (``[width, D]`` each),     the compressor steps
                     then the indexer's ``compressor.wkv | .wgate`` and     through its kernel
                     ``weights_proj [h, D]``
        ===========  =====================================================  ===========================

        Only replicated weights without bias are merged. Each linear keeps a view of its rows of the
        merged weight (no extra memory; prefill still calls it alone). The merged product is the
        same sums as the separate ones (each output row's dot over ``D``) in a different launch, so
        equal within float32 summation order, not bitwise. ``SHARDSMITH_KERNELS=merge_projections=reference`` keeps them apart
        (to compare)."""
        if self.x_fp8 is not None or self.x_dense is not None or not settings.current().merge_projections:
            return
        fp8 = [self.wq_a, self.wkv]
        if all(type(m) is ReplicatedLinear and m.kernel and m.bias is None and m.block == fp8[0].block
               and m.weight.shape[0] % m.block[0] == 0 and m.weight_scale_inv.dtype == fp8[0].weight_scale_inv.dtype
               for m in fp8):
            self.x_fp8 = (merge_rows(fp8, "weight"), merge_rows(fp8, "weight_scale_inv"))
        if self.compressor is not None and self.compressor.kernel:
            dense = [self.compressor.wkv, self.compressor.wgate]
            if self.indexer is not None:
                dense += [self.indexer.compressor.wkv, self.indexer.compressor.wgate, self.indexer.weights_proj]
            if all(type(m) is ReplicatedLinear and m.block is None and m.bias is None
                   and m.weight.dtype == dense[0].weight.dtype for m in dense):
                self.x_dense = merge_rows(dense, "weight")

    def state_bytes_for(self, num_slots: int, max_seq_len: int, dtype: torch.dtype, *, runs: int = 1) -> int:
        """Bytes of :meth:`state` that :meth:`allocate` would make for ``num_slots`` slots of
        ``max_seq_len`` positions (window rings and compressors), allocating nothing."""
        window = num_slots * (self.window + runs - 1) * self.head_dim * dtype.itemsize
        return window + sum(c.state_bytes_for(num_slots, max_seq_len, dtype) for c in self._compressors())

    def state(self) -> list[torch.Tensor]:
        """The preallocated per-slot state tensors of this layer (window ring, compressors)."""
        return [self.win, *(t for mod in self._compressors() for t in mod.state())]

    def reset(self, slot: int) -> None:
        """Forget slot ``slot``'s sequence. The window needs nothing: rows of earlier sequences are
        masked by position (a fresh sequence sees only positions >= 0 it wrote itself)."""
        if self._saved is not None and self._saved[0] == slot:
            self._saved = None
        for mod in self._compressors():
            mod.reset(slot)

    def save(self, slot: int, start: int, T: int) -> None:
        """Before a ``T``-token step of slot ``slot`` at ``start`` (``T <= window``): keep the window
        rows it will write over and the compressors' state (:meth:`Compressor.save`), for :meth:`rewind`."""
        ring = torch.arange(start, start + T, device=self.win.device) % self.ring
        self._saved = (slot, ring, self.win[slot, ring].clone())
        for mod in self._compressors():
            mod.save(slot)

    def rewind(self, slot: int, start: int, keep: int) -> None:
        """After the saved step: keep its first ``keep`` rows, take back the rest (the window rows they
        wrote over return; the compressors retake the kept rows).

        Raises:
            UsageError: no step of ``slot`` was saved.
        """
        if self._saved is None or self._saved[0] != slot:
            raise UsageError(f"slot {slot}: no saved step to rewind")
        _, ring, rows = self._saved
        self._saved = None
        self.win[slot, ring[keep:]] = rows[keep:]
        for mod in self._compressors():
            mod.rewind(slot, start, keep)

    def reserve_runs(self, rows: int) -> None:
        """Keep room for a decode step's run rows (``rows``: the most rows of a step), so that
        :meth:`rewind_run` can take back a run's later rows (:meth:`Compressor.reserve_runs`)."""
        for mod in self._compressors():
            mod.reserve_runs(rows)

    def rewind_run(self, slot: torch.Tensor, first: torch.Tensor, rows: int, start: torch.Tensor,
                   keep: list[DecodeRows]) -> None:
        """After a decode step in which slot ``slot`` had a run of ``rows`` rows from row ``first`` on, at
        positions from ``start``: keep its first ``len(keep)`` rows (``keep[j]``: row ``j``'s one-row
        rows, slot ``slot``), take back the rest. The window ring needs nothing: a taken-back row's
        ring row holds a position its slot's later rows do not see until they write it again
        (:meth:`DecodeRows.window`), and it wrote over only positions ``R`` behind it, outside the
        window; the compressors retake the kept rows (:meth:`Compressor.rewind_run`)."""
        for mod in self._compressors():
            mod.rewind_run(slot, first, rows, start, keep)

    def _compressors(self) -> list[Compressor]:
        return [m for m in (self.compressor, self.indexer and self.indexer.compressor) if m is not None]

    def forward(self, x: torch.Tensor, start: int, slot: int = 0) -> torch.Tensor:
        """Attend new tokens ``x`` ``[T, D]`` of slot ``slot`` at positions ``[start, start + T)``;
        returns ``[T, D]`` (reduced). One token runs the batched decode core (one row, its exact length
        as bucket: :meth:`one_row`); the decode pieces run the same kernels on a bucket's columns."""
        T = x.shape[0]
        positions = torch.arange(start, start + T, device=x.device)
        cos, sin = rope_cos_sin(positions, self.freqs)  # [T, r/2]
        q, kv, q_lora, *side = self.project(x, cos, sin, side=T == 1)
        if T == 1:
            out = self.decode_core(q, kv, side, self.one_row(positions, slot, start))
        else:
            out = self.core(x, q, kv, q_lora, positions, start, slot)
        return self.output(out, cos, sin)

    def one_row(self, positions: torch.Tensor, slot: int, start: int) -> DecodeRows:
        """The rows of a one-token step of slot ``slot`` at ``start`` (``positions`` ``[1]`` on the
        device), for :meth:`forward`: one real row, and the exact length ``start + 1`` as its bucket, so
        that every entry column is visible and the indexer's ``topk`` runs over exactly the complete
        entries, as transformers' does (exact ties of index scores then break as there; a bucketed
        step of :meth:`DeepseekV4.decode_step` is the same up to such ties)."""
        E = self.compressor.entries.shape[1] if self.compressor is not None else 0
        spec = RowsSpec(self.window, (self.ratio,) if E else (), self.max_seq_len,
                        {self.table: self.freqs}, self.ring - self.window + 1)
        index = torch.full((1,), slot, dtype=torch.int64, device=positions.device)
        return DecodeRows(positions, index, start + 1, self.keys.shape[0] - 1, spec)

    # forward in three parts: project and output are row-wise; the decode core reads and appends to each
    # row's slot with shapes fixed by the rows and their length bucket, so all three can be captured

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *,
                side: bool = True) -> tuple[torch.Tensor, ...]:
        """Queries ``[T, n, d]``, the new key/value rows ``[T, d]`` (RoPE applied), ``q_lora [T, q_lora]``,
        then (``side``) the row-wise inputs :meth:`decode_core` hands the compressors and indexer:

        ==========  =====================================================================
        layer       side
        ==========  =====================================================================
        sliding     none
        HCA         the compressor's ``kv_gate`` ``[T, 2, d]``
        CSA         the indexer's ``(kv_gate [T, 2, 2c], q [T, h, c], w [T, h])``, then the
                    compressor's ``kv_gate [T, 2, 2d]`` (:meth:`Indexer.project`, :meth:`Compressor.project`)
        ==========  =====================================================================

        A decode step computes them in its captured ``attn_in`` piece (``cos``/``sin`` are this layer's
        table, which on compressed layers is the indexer's too); a prefill leaves them out (``side``
        False): its compressors project the chunk themselves.
        """
        T, d = x.shape[0], self.head_dim
        if self.x_fp8 is not None:  # wq_a | wkv in one launch (fuse_projections_)
            q_a, kv = fp8_linear(x, *self.x_fp8, self.wq_a.block, backend="triton").split(
                (self.wq_a.weight.shape[0], d), dim=-1)
        else:
            q_a, kv = self.wq_a(x), self.wkv(x)
        q_lora = self.q_norm(q_a)  # [T, q_lora]
        q = query_heads(self.wq_b(q_lora).view(T, self.n_heads, d), cos, sin, self.eps)  # [T, n, d]
        kv = kv_rows(kv, self.kv_norm.weight, cos, sin, self.kv_norm.eps)  # [T, d]
        out = (q, kv, q_lora)
        if not side or self.compressor is None:
            return out
        if self.x_dense is None:
            if self.indexer is not None:
                out += self.indexer.project(x, q_lora, cos, sin)
            return out + (self.compressor.project(x),)
        # the compressors' kv | gate rows and the indexer's head weights in one GEMM (fuse_projections_)
        y = F.linear(x, self.x_dense)
        main = 2 * self.compressor.width
        kv_gate = y[:, :main].view(T, 2, self.compressor.width)  # [T, 2, width]: stack((wkv x, wgate x), 1)
        if self.indexer is not None:
            ix = self.indexer
            width = ix.compressor.width
            ix_kv_gate = y[:, main:main + 2 * width].view(T, 2, width)
            out += (ix_kv_gate, *ix.query(x, q_lora, cos, sin, weights=y[:, main + 2 * width:]))
        return out + (kv_gate,)

    def core(self, x: torch.Tensor, q: torch.Tensor, kv: torch.Tensor, q_lora: torch.Tensor,
             positions: torch.Tensor, start: int, slot: int) -> torch.Tensor:
        """One sequence's ``T`` new rows (a prefill or a chunk of one) into slot ``slot``'s window and
        compressor state; attention output ``[T, n, d]``. ``start`` is the slot's position."""
        T, W = x.shape[0], self.window
        first = max(0, start - (W - 1))  # position of keys[0]: the oldest key the first query sees
        R = self.ring
        old = self.win[slot, torch.arange(first, start, device=x.device) % R]  # [start - first, d]
        keys = torch.cat((old, kv))  # [S, d] in position order
        keep = max(start, start + T - R)  # the last R positions stay in the ring
        self.win[slot, torch.arange(keep, start + T, device=x.device) % R] = kv[keep - start:]
        entries = select = None
        if self.compressor is not None:
            entries = self.compressor.extend(x, slot, start)  # [C, d]
            if self.indexer is not None:
                select = self.indexer(x, q_lora, positions, slot, start, kernel=self.prefill_kernel)  # [T, K]
        return prefill_attention(q, keys, entries, select, self.attn_sink, self.head_dim ** -0.5, q0=start,
                                 first=first, window=W, ratio=self.ratio or 1,
                                 backend="auto" if self.prefill_kernel else "reference")  # [T, n, d]

    def decode_core(self, q: torch.Tensor, kv: torch.Tensor, side: list[torch.Tensor] | tuple[torch.Tensor, ...],
                    rows: DecodeRows) -> torch.Tensor:
        """One token for each of ``B`` rows: row ``i`` is slot ``rows.index[i]``'s token at
        ``rows.positions[i]`` (padding rows: the scratch slot, whose state is garbage but finite).

        Appends each row's key to its slot's window ring and compressors, then attends each query
        over its own slot's keys, all rows at once: ``keys[index, :S]`` with ``S = 1 + W + C`` (sink,
        window, the first ``C`` entries, ``C`` the length bucket's columns; :meth:`allocate`'s layout)
        and an additive bias ``[B, n, S]``: ``attn_sink`` on the sink, ``-inf`` on window rows not
        yet written and entries the row may not see (incomplete, or not the indexer's top-k on CSA
        layers). The masks are the step's (:class:`DecodeRows`, shared by the layers). The sink's
        zero value row adds nothing, so ``softmax`` over all ``S`` columns then ``probs @ keys`` is
        the softmax with a dropped sink column.

        Device-only with shapes fixed by ``(B, rows.key)``: no host value, no host-device copy, so
        it can be captured in a CUDA graph and replayed for any positions below the bucket.

        Args:
            q: ``[B, n, d]``; kv: ``[B, d]``; side: :meth:`project`'s side inputs of the ``B`` rows;
            rows: the step's rows (real slots distinct, positions checked by the caller).

        Returns:
            ``[B, n, d]`` attention output.
        """
        col, _ = rows.window()
        self.win[rows.index, col] = kv
        ratio = None
        if self.compressor is not None and self.compressor.entries.shape[1]:  # E = 0: statically nothing
            ratio = self.ratio
            if self.indexer is not None:
                select = self.indexer.step(*side[:3], rows, kernel=self.index_kernel)  # [B, C]
            self.compressor.step(side[-1], rows)
        if ratio is not None and self.indexer is not None:  # CSA: the window, then the indexer's picks
            biases = (rows.window()[1], select)  # [B, W], [B, C]
        else:
            biases = (rows.keys_bias(ratio),)  # [B, W (+ C)]: window, and every complete entry
        return sink_attention(q, self.keys, rows.index, biases, self.attn_sink, self.head_dim ** -0.5,
                              backend="auto" if self.kernel else "reference")  # [B, n, d]

    def warm_kernel(self, seen: set, *, dtype: torch.dtype | None = None) -> int:
        """Launch :func:`sink_attention` (and on CSA layers :func:`indexer_scores`) once on zero queries
        against slot 0's keys (read only), so their kernels compile before serving (``engine/warmup.py``), unless a layer of the same variant did
        (``seen``: what decides the variants); returns the launches (0 or 1). ``dtype``: unused (the keys' decides)."""
        n, d, W = self.n_heads, self.head_dim, self.ring
        C = min(self.keys.shape[1] - 1 - W, 16) if self.indexer is not None else 0
        key = ("sink_attention", n, d, self.keys.dtype, C > 0, self.index_kernel, self.keys.stride())
        if key in seen:
            return 0
        seen.add(key)
        q = torch.zeros(1, n, d, dtype=self.keys.dtype, device=self.keys.device)
        biases = (q.new_zeros(1, W, dtype=torch.float32),) + ((q.new_zeros(1, C, dtype=torch.float32),) if C else ())
        index = torch.zeros(1, dtype=torch.int64, device=q.device)
        sink_attention(q, self.keys, index, biases, self.attn_sink, d ** -0.5)
        if C and self.index_kernel:  # CSA: the indexer's scores too
            ix = self.indexer
            indexer_scores(q.new_zeros(1, ix.heads, ix.head_dim), q.new_zeros(1, ix.heads, dtype=torch.float32),
                           ix.compressor.entries, index, C)
        return 1

    def use_kernel_(self, device: torch.device) -> None:
        """Run the decode core's attention through :func:`sink_attention`'s Triton kernels when
        ``SHARDSMITH_KERNELS=decode_attention`` allows on ``device`` (``auto``: on CUDA; ``reference``: the PyTorch
        path), and with it a CSA layer's index scores through :func:`indexer_scores` when
        ``SHARDSMITH_KERNELS=indexer_scores`` allows (``auto``, the default, or ``kernel``; ``reference``: its reference);
        and a prefill chunk's attention through :func:`prefill_attention` (and its index scores through
        :func:`indexer_scores`) when ``SHARDSMITH_KERNELS=prefill_attention`` allows."""
        self.kernel = kernel_on("decode_attention", device)
        self.index_kernel = self.kernel and kernel_on("indexer_scores", device)
        self.prefill_kernel = kernel_on("prefill_attention", device)

    def output(self, out: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Inverse RoPE, grouped ``wo_a``, row-parallel ``wo_b`` (the all-reduce): ``[T, n, d] -> [T, D]``."""
        T = out.shape[0]
        groups = self.wo_a.weight.shape[0] // self.o_rank  # G: whole output groups of this rank's heads
        out = unrope(out, cos, sin).reshape(T, groups, -1)  # [T, G, n*d/G]
        return self.wo_b(self.wo_a.grouped(out))  # [T, G*o] -> [T, D]


@for_chunks
def query_heads(q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, eps: float) -> torch.Tensor:
    """Each head of ``q [T, n, d]`` over its rms (unweighted), then RoPE at ``cos``/``sin`` ``[T, r/2]``."""
    return apply_rope(rms_unweighted(q, eps), cos, sin)


@for_chunks
def kv_rows(kv: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, eps: float) -> torch.Tensor:
    """The KV rows ``kv [T, d]``: ``kv_norm`` (``weight [d]`` float32, ``eps``) then RoPE (fused for a chunk's rows)."""
    return apply_rope(RMSNormF32.normalize(kv, weight, eps), cos, sin)


@for_chunks
def unrope(out: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The inverse rotation of the attention output ``[T, n, d]`` (RoPE at ``-sin``)."""
    return apply_rope(out, cos, -sin)
