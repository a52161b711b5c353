"""A Llama-architecture GGUF of any shape with random weights and SmolLM2's tokenizer, for
serving and benchmarking models bigger than the embedded one (no model hub here).

Every linear is one block type (Q4_0, Q4_1 or Q8_0, as a pure llama.cpp quantization
writes them), the token embedding Q8_0, the norms F32; the weights are Gaussian, so the
text is nonsense but the shapes, bytes and kernels are a real model's. With the defaults,
365 M linear weights: their float32 copies (1.46 GB) are past gguf.DENSE_FLOAT32_MAX_BYTES,
so the Q4 records stand in for them (bench/RESULTS.md item 34).

    python -m bench.random_gguf OUT.gguf [--hidden 1024] [--heads 16] [--kv-heads 4]
        [--intermediate 4096] [--layers 24] [--type Q4_1] [--seed 0]
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import gguf

LINEARS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def linear_shapes(hidden: int, heads: int, kv_heads: int, intermediate: int) -> dict[str, tuple[int, int]]:
    """(rows, columns) of each layer's linear, as GGUF stores them (out, in)."""
    kv = kv_heads * (hidden // heads)
    return {
        "attn_q": (hidden, hidden), "attn_k": (kv, hidden), "attn_v": (kv, hidden), "attn_output": (hidden, hidden),
        "ffn_gate": (intermediate, hidden), "ffn_up": (intermediate, hidden), "ffn_down": (hidden, intermediate),
    }  # fmt: skip


def write_random_gguf(
    out: Path, *, hidden: int, heads: int, kv_heads: int, intermediate: int, layers: int, qtype: str = "Q4_1",
    seed: int = 0, context: int = 4096, tokenizer_from: gguf.GGUFReader | None = None,
) -> None:  # fmt: skip
    """`tokenizer_from`: the GGUF whose tokenizer and chat template to copy (default: the
    embedded model's; opening it parses 49k-entry arrays, ~6 s)."""
    import gguf
    import numpy as np

    from runtime.model_executor.model_loader import default_model_path

    src = tokenizer_from or gguf.GGUFReader(default_model_path())

    def field(key: str) -> object:
        return src.fields[key].contents()

    w = gguf.GGUFWriter(out, "llama")
    w.add_name(f"random-llama-{hidden}x{layers}")
    w.add_block_count(layers)
    w.add_context_length(context)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(intermediate)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_dimension_count(hidden // heads)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    vocab = len(field("tokenizer.ggml.tokens"))  # type: ignore[arg-type]
    w.add_vocab_size(vocab)
    w.add_tokenizer_model(field("tokenizer.ggml.model"))
    w.add_tokenizer_pre(field("tokenizer.ggml.pre"))
    w.add_token_list(field("tokenizer.ggml.tokens"))
    w.add_token_types(field("tokenizer.ggml.token_type"))
    w.add_token_merges(field("tokenizer.ggml.merges"))
    w.add_bos_token_id(field("tokenizer.ggml.bos_token_id"))
    w.add_eos_token_id(field("tokenizer.ggml.eos_token_id"))
    w.add_unk_token_id(field("tokenizer.ggml.unknown_token_id"))
    w.add_pad_token_id(field("tokenizer.ggml.padding_token_id"))
    w.add_add_bos_token(False)
    w.add_chat_template(field("tokenizer.chat_template"))

    rng = np.random.default_rng(seed)

    def tensor(name: str, shape: tuple[int, ...], kind: str, std: float) -> None:
        values = (rng.standard_normal(shape) * std).astype(np.float32)
        t = gguf.GGMLQuantizationType[kind]
        w.add_tensor(name, values if kind == "F32" else gguf.quantize(values, t), raw_dtype=t)

    tensor("token_embd.weight", (vocab, hidden), "Q8_0", 0.5)
    tensor("output_norm.weight", (hidden,), "F32", 0.1)
    shapes = linear_shapes(hidden, heads, kv_heads, intermediate)
    for i in range(layers):
        tensor(f"blk.{i}.attn_norm.weight", (hidden,), "F32", 0.1)
        tensor(f"blk.{i}.ffn_norm.weight", (hidden,), "F32", 0.1)
        for name in LINEARS:
            tensor(f"blk.{i}.{name}.weight", shapes[name], qtype, 0.2)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("output", type=Path)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--intermediate", type=int, default=4096)
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--type", choices=["Q4_0", "Q4_1", "Q8_0"], default="Q4_1")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    a.output.parent.mkdir(parents=True, exist_ok=True)
    write_random_gguf(
        a.output, hidden=a.hidden, heads=a.heads, kv_heads=a.kv_heads, intermediate=a.intermediate, layers=a.layers,
        qtype=a.type, seed=a.seed,
    )  # fmt: skip
    weights = a.layers * sum(r * c for r, c in linear_shapes(a.hidden, a.heads, a.kv_heads, a.intermediate).values())
    print(f"wrote {a.output}: {a.layers} layers, {weights / 1e6:.0f} M linear weights as {a.type}")


if __name__ == "__main__":
    main()
