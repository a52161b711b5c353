"""The LM head as int8 blocks of 32 (llama.cpp's Q8_0), when that is exact.

The embedded GGUF stores its tied embedding / LM head as Q8_0: every row is blocks of
32 values `d * q` (`d` a float16 scale, `q` in [-127, 127]), which the conversion
dequantizes to float32 exactly. Re-deriving the blocks from that float32 weight
gives back the file's `d` and `q` (the block's largest |value| is `127 * d`, and
`127 * d / 127` rounds to `d` exactly), so the packed form computes with the very
same weights at a quarter of the bytes, which a batch-1 decode step has to read
(113 MB -> 31 MB for SmolLM2's 49152 x 576 head). `pack_q8_exact` packs only when
`q * d` reproduces every weight bit for bit; anything else (bfloat16 weights, an
HF checkpoint) stays float, so the packing never changes a logit's inputs.
The matmul is `kernels/cpu/q8_linear.cpp` (float32 activations, per-row order).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

GROUP = 32  # columns per scale
LANES = 16  # output rows per packed block (one AVX-512 vector of outputs)


class Q8Weight(NamedTuple):
    qw: torch.Tensor  # int8 [N / 16, K, 16]
    scales: torch.Tensor  # float32 [N / 16, K / 32, 16]


def pack_q8_vnni(weight: Q8Weight) -> torch.Tensor:
    """The same blocks as `kernels/cpu/q4_linear.cpp`'s Q8 records, uint8 `[N / 16, K / 32, 576]`:
    per 16 rows and 32 columns, the codes `q + 128` (unsigned, as vpdpbusd wants them) by
    column quad (byte 4j + t of quad c = row j, column 4c + t), then d as float32; the
    kernel adds `m = -128 d` (exact), so that `d * (q + 128) + m = d * q` exactly."""
    blocks, k, _ = weight.qw.shape
    g = k // GROUP
    codes = (weight.qw.to(torch.int16) + 128).to(torch.uint8)  # [block, K, j]
    codes = codes.view(blocks, g, 8, 4, LANES).transpose(3, 4).reshape(blocks, g, 512)
    d = weight.scales.contiguous()  # [block, G, 16]
    return torch.cat([codes, d.view(torch.uint8)], dim=-1).contiguous()


def q8_blocks(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 `[N, K]` -> (`q` int8 `[N, K]`, `d` float32 `[N, K / 32]`), `d = max|w| / 127` per block."""
    n, k = weight.shape
    blocks = weight.view(n, k // GROUP, GROUP)
    d = blocks.abs().amax(dim=-1) / 127
    q = torch.round(blocks / torch.where(d > 0, d, 1.0)[..., None]).clamp(-127, 127)
    return q.to(torch.int8).view(n, k), d


def pack_q8_exact(weight: torch.Tensor) -> Q8Weight | None:
    """The packed form of a float32 `[N, K]` weight, or None unless it is exactly Q8 blocks
    (and the shape fits the kernel: N % 16 == 0, K % 32 == 0)."""
    n, k = weight.shape
    if weight.dtype != torch.float32 or weight.device.type != "cpu" or n % LANES or k % GROUP:
        return None
    probe = weight[: min(n, 64)]  # most weights fail on their first rows: skip the full pass
    for w in (probe, weight):
        q, d = q8_blocks(w)
        if not torch.equal(q.view(w.shape[0], k // GROUP, GROUP).float() * d[..., None], w.view(w.shape[0], k // GROUP, GROUP)):
            return None
    qw = q.view(n // LANES, LANES, k).transpose(1, 2).contiguous()
    scales = d.view(n // LANES, LANES, k // GROUP).transpose(1, 2).contiguous()
    return Q8Weight(qw, scales)
