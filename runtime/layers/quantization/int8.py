"""int8 weight-only linear: symmetric, one scale per output channel.

`w[n, :] ~= qweight[n, :] * scales[n]`, `qweight` int8 in [-127, 127] (-128 unused,
so the grid is symmetric). The matmul is torch's CPU kernel `_weight_int8pack_mm`,
which dequantizes on the fly; it takes float32 activations too, but its float32
path is many times slower than its bfloat16 one, so activations are cast to bfloat16
on the way in and the output back to the input dtype.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, cast

import torch
from torch import nn

from runtime.layers.linear import UnquantizedLinearMethod

if TYPE_CHECKING:
    from runtime.layers.linear import LinearBase

ACT_DTYPE = (
    torch.bfloat16
)  # the kernels' fast activation dtype; scales are stored in it too


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`w [N, K]` -> (`qweight` int8 [N, K], `scales` [N] in ACT_DTYPE). The scale is
    rounded to ACT_DTYPE before `w` is divided by it, so `qweight * scales` is the best
    int8 grid for the scale the kernel actually reads."""
    w = w.float()
    scales = (w.abs().amax(dim=1) / 127).clamp(min=1e-12).to(ACT_DTYPE)
    qweight = torch.round(w / scales.float()[:, None]).clamp(-127, 127).to(torch.int8)
    return qweight, scales


def dequantize_int8(qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return qweight.float() * scales.float()[:, None]


class Int8LinearMethod(UnquantizedLinearMethod):
    """Loads the float weight as `UnquantizedLinearMethod` does; after loading, holds
    `qweight: [out, in]` int8 and `scales: [out]` instead."""

    row_invariant: ClassVar[bool] = True  # like int4's kernel: one K loop per output row, any M

    def process_weights_after_loading(self, layer: LinearBase) -> None:
        qweight, scales = quantize_int8(layer.weight.data)
        del layer.weight  # the float weight goes: the packed tensors replace it
        layer.qweight = nn.Parameter(qweight, requires_grad=False)
        layer.scales = nn.Parameter(scales, requires_grad=False)

    def apply(
        self, layer: LinearBase, x: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        # The kernel takes a 2-D activation with a contiguous last dim.
        x2 = x.reshape(-1, x.shape[-1]).to(ACT_DTYPE).contiguous()
        out = torch._weight_int8pack_mm(
            x2, cast(torch.Tensor, layer.qweight), cast(torch.Tensor, layer.scales)
        ).to(x.dtype)
        out = out.view(*x.shape[:-1], out.shape[-1])
        return out if bias is None else out + bias

    def dequantize(self, layer: LinearBase) -> torch.Tensor:
        """The float32 weight `[out, in]` the layer computes with."""
        return dequantize_int8(
            cast(torch.Tensor, layer.qweight), cast(torch.Tensor, layer.scales)
        )
