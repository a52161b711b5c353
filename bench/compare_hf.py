"""HF transformers `generate` on exactly the requests sluice ran, at its best honest setting.

Setting: the same weights, dtype and device as sluice (`--hf-dtype` to try another dtype),
batches of `--hf-batch-size` (32) with left padding and an attention mask,
greedy (`do_sample=False`), each batch generating its longest requested output
(`max_new_tokens = min_new_tokens = max(out_lens)`, so EOS cannot end it early).
Only the tokens each request asked for count as output; the rest of a batch's
steps are HF's padding waste, reported separately. Requests are sorted before
batching (`--hf-sort`, default by output length then input length: both cut
HF's padding; allowed as its best setting).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench.datasets import BenchRequest

if TYPE_CHECKING:
    import torch

DTYPES = ("float32", "bfloat16", "float16")
SORTS = ("output", "input", "none")


def torch_dtype(name: str) -> torch.dtype:
    import torch

    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def load_hf_model(model_dir: str | Path, dtype: torch.dtype, real_weights: bool, device: str = "cpu") -> Any:
    """The checkpoint's weights, or (dummy-weight runs, checkpoints without weights)
    a randomly initialised model of the same shape: speed does not depend on values.
    Built on `device` (the engine's), so a GPU run is not compared with HF on the host."""
    from transformers import AutoConfig, AutoModelForCausalLM

    has_weights = any(Path(model_dir).glob("*.safetensors"))
    if real_weights and has_weights:
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).to(device)
    else:
        import torch

        config = AutoConfig.from_pretrained(str(model_dir))
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


def batch_order(requests: list[BenchRequest], sort: str) -> list[int]:
    idx = list(range(len(requests)))
    if sort == "output":
        idx.sort(key=lambda i: (-requests[i].output_len, -requests[i].prompt_len))
    elif sort == "input":
        idx.sort(key=lambda i: (-requests[i].prompt_len, -requests[i].output_len))
    return idx


def _generate_batch(model: Any, prompts: list[list[int]], new_tokens: int, pad_id: int) -> torch.Tensor:
    import torch

    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, p in enumerate(prompts):  # left padding
        ids[row, width - len(p) :] = torch.tensor(p, dtype=torch.long)
        mask[row, width - len(p) :] = 1
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids.to(model.device),
            attention_mask=mask.to(model.device),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            temperature=None,
            top_p=None,
            top_k=None,
            pad_token_id=pad_id,
        )
    return out[:, width:].cpu()  # on a GPU, the copy waits for the batch: timing stays honest


def run_hf(
    model_dir: str | Path,
    requests: list[BenchRequest],
    dtype: torch.dtype,
    *,
    batch_size: int = 32,
    sort: str = "output",
    real_weights: bool = True,
    device: str = "cpu",
    pad_token_id: int | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """Time HF generate over `requests`; returns throughput and each request's output ids."""
    t_load = time.perf_counter()
    model = load_hf_model(model_dir, dtype, real_weights, device)
    load_s = time.perf_counter() - t_load
    cfg = model.config
    pad = pad_token_id if pad_token_id is not None else (cfg.pad_token_id if cfg.pad_token_id is not None else 0)
    if isinstance(pad, list):
        pad = pad[0]
    _generate_batch(model, [requests[0].prompt_ids[:16]], 2, pad)  # warm-up, untimed

    order = batch_order(requests, sort)
    outputs: list[list[int]] = [[] for _ in requests]
    generated = 0
    from tqdm.auto import tqdm

    bar = tqdm(total=len(requests), disable=not progress, desc="HF generate")
    start = time.perf_counter()
    for b in range(0, len(order), batch_size):
        chunk = order[b : b + batch_size]
        steps = max(requests[i].output_len for i in chunk)
        out = _generate_batch(model, [requests[i].prompt_ids for i in chunk], steps, pad)
        assert out.shape[1] == steps, f"HF generated {out.shape[1]} tokens, asked for {steps}"
        generated += out.numel()
        for row, i in enumerate(chunk):
            outputs[i] = out[row, : requests[i].output_len].tolist()
        bar.update(len(chunk))
    duration = time.perf_counter() - start
    bar.close()
    total_in = sum(r.prompt_len for r in requests)
    total_out = sum(r.output_len for r in requests)
    del model
    return {
        "duration_s": duration,
        "load_s": load_s,
        "dtype": str(dtype).removeprefix("torch."),
        "device": device,
        "batch_size": batch_size,
        "sort": sort,
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "generated_incl_padding_steps": generated,
        "request_throughput": len(requests) / duration,
        "input_throughput": total_in / duration,
        "output_throughput": total_out / duration,
        "total_throughput": (total_in + total_out) / duration,
        "outputs": outputs,
    }


def greedy_agreement(ours: list[list[int]], theirs: list[list[int]]) -> float:
    """Share of requests whose greedy outputs are identical (float32 ties may differ)."""
    same = sum(1 for a, b in zip(ours, theirs) if a == b)
    return same / max(len(ours), 1)
