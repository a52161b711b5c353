"""bench/random_gguf.py: the stand-in for models bigger than the embedded one must be the
GGUF it claims (shapes, block types, the embedded model's tokenizer), or item 34's figures
for a model past the float32 budget describe something else."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

from bench.random_gguf import LINEARS, linear_shapes, write_random_gguf
from runtime.model_executor.model_loader import default_model_path


def test_a_random_gguf_has_the_asked_shapes_block_type_and_the_embedded_tokenizer(tmp_path: Path) -> None:
    qtype = "Q4_0"  # (item 34's run wrote Q4_1)
    embedded = gguf.GGUFReader(default_model_path())
    out = tmp_path / "random.gguf"
    write_random_gguf(out, hidden=64, heads=4, kv_heads=2, intermediate=96, layers=2, qtype=qtype, tokenizer_from=embedded)
    reader = gguf.GGUFReader(out)
    tensors = {t.name: t for t in reader.tensors}
    shapes = linear_shapes(64, 4, 2, 96)
    assert shapes["attn_k"] == (32, 64) and shapes["ffn_down"] == (64, 96)
    for i in range(2):
        for name in LINEARS:
            t = tensors[f"blk.{i}.{name}.weight"]
            assert t.tensor_type == gguf.GGMLQuantizationType[qtype]
            assert tuple(int(d) for d in reversed(t.shape)) == shapes[name]  # GGUF lists dims innermost first
            values = gguf.dequantize(t.data, t.tensor_type)
            assert 0.1 < float(np.std(values)) < 0.3  # Gaussian weights (std 0.2), not zeros
    assert reader.fields["llama.block_count"].contents() == 2
    assert reader.fields["llama.attention.head_count_kv"].contents() == 2
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.chat_template", "tokenizer.ggml.eos_token_id"):
        assert reader.fields[key].contents() == embedded.fields[key].contents(), key
