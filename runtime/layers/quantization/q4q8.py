"""Q4 blocks x 16-bit fixed-point activations: a GGUF's Q4_0/Q4_1 linears on AVX512-VNNI or AVX2.

In sluice's kernel (kernels/cpu/q4_linear.cpp) the weight stays the file's blocks (per
row and 32 input columns, `w = d * q + m`, q in [0, 15], d and m fp16, so the packed
form is exact), and each activation row is rounded on the fly, per the same 32
columns, to two int8 planes: `x ~= u * (256 a + b)`, u = max|x| / 127 / 256. A block's
product is then two exact integer dot products (`vpdpbusd`: 64 multiply-adds an
instruction) scaled once: `d * u * (256 (q . a) + q . b) + m * u * (256 sum a + sum b)`.
The only loss is that rounding, ~1/65000 of a block's largest value: the model agrees
with float32 on every teacher-forced token measured (bench/RESULTS.md item 17), where
one int8 plane (llama.cpp's Q8_1 activations) lost 4 points.

At a few rows the step reads 4.5 bits a weight (memory-bound where torch's int4
kernel is compute-bound); at 16 rows the kernel runs at the integer units' rate (VNNI's
vpdpbusd, or AVX2's vpmaddubsw: the same integers, the same bits). For
big batches (prefill) a layer also keeps a dense copy, as the int4 path does
(int4.dense_matmul), from `dense_min_rows` rows on: in bfloat16 as the kernels' bf16_linear
tiles (AMX or AVX512-BF16), with float32 sums and output; elsewhere in float32, from more
rows (it reads 8x the bytes): as the kernels' f32_linear panels on AVX2, through oneDNN
otherwise.

A row's result never depends on the other rows of the call (per-row quantization and
accumulation order), so the method is batch-invariant as is; under deterministic
inference a prompt token's row takes the kernels' copy (tiles or panels) whatever the row
count, a generated token's the blocks (runtime/layers/batch_invariant.py PromptRows).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, ClassVar, cast

import torch

from runtime.layers.linear import UnquantizedLinearMethod
from runtime.layers.batch_invariant import prompt_rows
from runtime.layers.quantization.int4 import dense_matmul, dense_silu_mul, has_invariant_copy, invariant_matmul

if TYPE_CHECKING:
    from kernels.cpu import CpuOps
    from runtime.layers.linear import LinearBase

GROUP = 32  # input columns per block (llama.cpp's QK4_0 / QK4_1)
LANES = 16  # output rows per packed block: one AVX-512 vector of outputs
RECORD = 320  # bytes per (16 rows, 32 columns): 256 of nibbles, 32 of d, 32 of m
# The bfloat16 copy (AMX / AVX512-BF16) catches up with the kernel at this many rows:
# SmolLM2's 120 linears streamed from memory, 2 threads, took 10.2 / 14.7 / 19.2 ms at
# 16 / 24 / 32 rows vs the copy's 18.4 / 19.2 / 19.8 (bench/RESULTS.md item 18); from
# there the copy wins, below it the exact kernel is faster too.
DENSE_MIN_ROWS = 32
# A float32 copy (oneDNN on AVX2 CPUs, gguf.dense_dtype) streams 8x the Q4 bytes: on an AMD
# EPYC (Zen 2) the same 120 linears took 115.8 vs the copy's 127.1 ms at 64 rows and 238.6 vs
# 222.8 at 128 (bench/RESULTS.md item 27).
DENSE_MIN_ROWS_FLOAT32 = 128
# The same copy as the kernels' f32_linear panels (AVX2) overtakes the blocks at a row count
# that moves with the CPU: SmolLM2's 120 linears on 2 cores, blocks vs panels, took 53.7 vs
# 53.2 ms at 32 rows and 80.1 vs 67.6 at 48 on an AMD EPYC Zen 2 (two 256-bit FMAs a cycle),
# but 30.7 vs 28.2 at 6 rows and 73.3 vs 55.4 at 16 on a Zen 1, whose 256-bit integer and
# FMA instructions run as two 128-bit halves (bench/RESULTS.md item 28). So it is measured
# on the machine at load (measure_panels_min_rows), at these row counts, and kept on each
# layer as `panels_min_rows`; a layer not yet settled uses DENSE_MIN_ROWS_PANELS.
PANELS_TIMED_ROWS = (2, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128)
DENSE_MIN_ROWS_PANELS = 64

# Crossovers measured in this process, by what was timed (the kernel pair and the shapes of
# the weights timed): another engine of the same model reuses its row count, a differently
# shaped model is measured on its own weights.
measured_crossovers: dict[tuple[object, ...], int] = {}


def crossover_for(key: tuple[object, ...], measure: Callable[[], int]) -> int:
    """`measured_crossovers[key]`, measured by `measure` the first time it is asked for."""
    if key not in measured_crossovers:
        measured_crossovers[key] = measure()
    return measured_crossovers[key]


def dense_min_rows(layer: torch.nn.Module) -> int:
    """From how many rows `layer`'s dense copy takes a batch (the blocks take fewer)."""
    if hasattr(layer, "dense_panels"):
        return cast(int, getattr(layer, "panels_min_rows", DENSE_MIN_ROWS_PANELS))
    packed = getattr(layer, "dense_packed", None)
    return DENSE_MIN_ROWS_FLOAT32 if packed is not None and packed.dtype == torch.float32 else DENSE_MIN_ROWS


def pack_q4(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """Codes `q` uint8 `[N, K]` in [0, 15], `d` and `m` float16 `[N, K / 32]` -> the
    kernel's records uint8 `[N / 16, K / 32, 320]` (layout: kernels/cpu/q4_linear.cpp:
    in record chunk c, byte 4j + t = q[j, 8c + t] | q[j, 8c + 4 + t] << 4)."""
    n, k = q.shape
    if n % LANES or k % GROUP or d.dtype != torch.float16 or m.dtype != torch.float16:
        raise ValueError(f"q4 packing needs N % {LANES} == 0, K % {GROUP} == 0 and fp16 d, m; got {n} x {k}")
    g = k // GROUP
    # [block, row j, group, chunk c, half h, t] -> [block, group, c, j, t, h]
    codes = q.view(n // LANES, LANES, g, 4, 2, 4).permute(0, 2, 3, 1, 5, 4)
    nibbles = (codes[..., 0] | (codes[..., 1] << 4)).reshape(n // LANES, g, 256)

    def lanes(v: torch.Tensor) -> torch.Tensor:  # fp16 [N, G] -> bytes [N / 16, G, 32]
        return v.view(n // LANES, LANES, g).transpose(1, 2).contiguous().view(torch.uint8)

    return torch.cat([nibbles, lanes(d), lanes(m)], dim=-1).contiguous()


def unpack_q4(records: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The inverse of `pack_q4`: (q uint8 `[N, K]`, d, m float16 `[N, K / 32]`)."""
    blocks, g, _ = records.shape
    n, k = blocks * LANES, g * GROUP
    nibbles = records[..., :256].reshape(blocks, g, 4, LANES, 4)
    codes = torch.stack([nibbles & 0x0F, nibbles >> 4], dim=-1)  # [block, g, c, j, t, h]
    q = codes.permute(0, 3, 1, 2, 5, 4).reshape(n, k)

    def rows(b: torch.Tensor) -> torch.Tensor:  # bytes [N / 16, G, 32] -> fp16 [N, G]
        return b.contiguous().view(torch.float16).transpose(1, 2).reshape(n, g)

    return q.contiguous(), rows(records[..., 256:288]), rows(records[..., 288:320])


class Q4Q8LinearMethod(UnquantizedLinearMethod):
    """Computes with `layer.q4_weight` (pack_q4's records) through `ops.q4_linear`."""

    row_invariant: ClassVar[bool] = True

    def __init__(self, ops: CpuOps) -> None:
        self.ops = ops

    def apply(self, layer: LinearBase, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        dense = dense_matmul(layer, x, bias, dense_min_rows(layer), self.ops)
        if dense is not None:
            return dense
        rows = prompt_rows() if layer.batch_invariant and has_invariant_copy(layer) else None
        if rows is not None and rows.order is not None and rows.restore is not None:
            # Deterministic inference, given text and answers in one forward: each row on
            # its role's kernel (batch_invariant.PromptRows).
            xs, d = x.reshape(-1, x.shape[-1]).index_select(0, rows.order), rows.given
            out = torch.cat([invariant_matmul(layer, xs[:d], None, self.ops), self._blocks(layer, xs[d:])]).index_select(0, rows.restore)
        else:
            out = self._blocks(layer, x.reshape(-1, x.shape[-1]))
        out = out.view(*x.shape[:-1], out.shape[-1])
        return out if bias is None else out + bias

    def _blocks(self, layer: LinearBase, x2: torch.Tensor) -> torch.Tensor:
        return self.ops.q4_linear(x2.float(), cast(torch.Tensor, layer.q4_weight)).to(x2.dtype)

    def silu_mul_dense(self, layer: LinearBase, x: torch.Tensor) -> torch.Tensor | None:
        """`silu(gate) * up` of a gate|up layer straight from its tiles where `apply` would
        take the dense path (int4.dense_silu_mul); else None."""
        return dense_silu_mul(layer, x, dense_min_rows(layer), self.ops)

    def dequantize(self, layer: LinearBase) -> torch.Tensor:
        """The float32 weight `[out, in]` the layer computes with (`d * q + m`, exact)."""
        q, d, m = unpack_q4(cast(torch.Tensor, layer.q4_weight))
        n, k = q.shape
        w = q.float().view(n, k // GROUP, GROUP) * d.float()[..., None] + m.float()[..., None]
        return w.view(n, k)


# Timings within this ratio are a tie, which the copy takes: near the crossover the two are
# within a few percent, and fresh processes' timings there differ by as much (on a Zen 1,
# 6 to 12 rows measured without it).
TIE = 1.03


def crossover_rows(timings: Sequence[tuple[int, float, float]], never: int) -> int:
    """The fewest rows from which the dense copy is as fast as the blocks or faster (TIE)
    at every larger count timed. `timings`: (rows, blocks' seconds, copy's seconds), rows
    ascending; `never` where the copy loses at the largest."""
    rows = never
    for m, blocks, dense in reversed(timings):
        if dense > blocks * TIE:
            break
        rows = m
    return rows


# measure_panels_min_rows times this many bytes of panels (or of the records that stand in
# for them) or more (a forward streams its weights from memory; one decoder layer's would
# sit in a big L3), and stops once the panels have won at this many row counts in a row.
PANELS_TIMED_BYTES = 64 << 20
PANELS_WINS_TO_STOP = 3


def time_crossover(calls: Callable[[int], tuple[Callable[[], object], Callable[[], object]]], repeats: int = 2) -> int:
    """crossover_rows of two kernels timed here at PANELS_TIMED_ROWS ascending: `calls(m)`
    gives the blocks' and the copy's call on m rows (inputs made once), run interleaved,
    best of `repeats` after a warm-up, stopping after PANELS_WINS_TO_STOP wins in a row."""
    timings: list[tuple[int, float, float]] = []
    for m in PANELS_TIMED_ROWS:
        pair = calls(m)
        best = [math.inf, math.inf]
        for rep in range(repeats + 1):
            for i, call in enumerate(pair):
                start = time.perf_counter()
                call()
                if rep:
                    best[i] = min(best[i], time.perf_counter() - start)
        timings.append((m, best[0], best[1]))
        if len(timings) >= PANELS_WINS_TO_STOP and all(d <= b * TIE for _, b, d in timings[-PANELS_WINS_TO_STOP:]):
            break
    return crossover_rows(timings, never=2 * PANELS_TIMED_ROWS[-1])


def panels_timed(layers: Sequence[LinearBase]) -> list[LinearBase]:
    """The first of `layers` (q4q8 linears with panels, in model order) that hold
    PANELS_TIMED_BYTES of panels: what measure_panels_min_rows times."""
    timed: list[LinearBase] = []
    for layer in layers:
        if sum(cast(torch.Tensor, t.dense_panels).nbytes for t in timed) >= PANELS_TIMED_BYTES:
            break
        timed.append(layer)
    return timed


def measure_panels_min_rows(timed: Sequence[LinearBase], ops: CpuOps, repeats: int = 2) -> int:
    """time_crossover of `timed` (panels_timed's layers) on their blocks and on their
    panels (SmolLM2 on 2 cores: ~0.2-0.4 s on a Zen 1, ~1 s on a Zen 2)."""

    def calls(m: int) -> tuple[Callable[[], object], Callable[[], object]]:
        xs = [torch.randn(m, layer.input_size_per_partition) for layer in timed]
        pairs = [(x, cast(torch.Tensor, t.q4_weight), cast(torch.Tensor, t.dense_panels)) for x, t in zip(xs, timed, strict=True)]
        return (lambda: [ops.q4_linear(x, q4) for x, q4, _ in pairs]), (lambda: [ops.f32_linear(x, p) for x, _, p in pairs])

    return time_crossover(calls, repeats)
