"""StubWorker: a Worker with no model, for the fast scheduler tests and benchmarks.

It keeps what a real worker keeps (its own req_to_token copy, written by the same
`write_req_to_token`, and a "KV pool" that stores each slot's token id) and answers
every request with `next_token(tokens)`, where `tokens` is the sequence it *reads
back through req_to_token and the KV slots*. So a scheduler bug that feeds the
wrong slots, positions or future ids changes the output, exactly as it would with
a real model, and `greedy_reference` is the oracle the outputs must equal.
"""

from __future__ import annotations

from concurrent.futures import Executor, Future

import torch

from runtime.model_executor.future_map import FutureMap
from runtime.model_executor.pooler import EmbeddingResult, Pooler, PoolingMethod
from runtime.model_executor.worker import BatchResult, ModelWorkerBatch, write_req_to_token

_MULT = 0x9E3779B1  # Knuth's multiplicative hash constant
# A prime modulus (2**61 - 1): with a power of two, vocab sizes sharing its factors
# (49152 = 3 * 2**14) drive the low bits to a fixed point within ~14 tokens.
_PRIME = (1 << 61) - 1


def next_token(tokens: list[int], vocab_size: int) -> int:
    """A deterministic "model": a polynomial hash of the whole sequence, in the vocab."""
    h = 0
    for t in tokens:
        h = (h * _MULT + t + 1) % _PRIME
    return h % vocab_size


def greedy_reference(prompt: list[int], max_new_tokens: int, vocab_size: int, stop_ids: frozenset[int] = frozenset()) -> list[int]:
    """What any correct scheduler must produce for `prompt` on a StubWorker."""
    seq, out = list(prompt), []
    for _ in range(max_new_tokens):
        tok = next_token(seq, vocab_size)
        out.append(tok)
        seq.append(tok)
        if tok in stop_ids:
            break
    return out


STUB_HIDDEN_SIZE = 8  # of the stub's "hidden states" on an embedding server


def stub_hidden_states(tokens: list[int]) -> torch.Tensor:
    """The stub's final hidden states `[len(tokens), STUB_HIDDEN_SIZE]`: position p's is a
    function of `tokens[: p + 1]` (causal, as a real model's are), from the same hash."""
    h, rows = 0, []
    for t in tokens:
        h = (h * _MULT + t + 1) % _PRIME
        rows.append([((h >> (7 * j)) & 127) / 64.0 - 1.0 for j in range(STUB_HIDDEN_SIZE)])
    return torch.tensor(rows, dtype=torch.float32).reshape(len(tokens), STUB_HIDDEN_SIZE)


def embedding_reference(prompt: list[int], method: PoolingMethod) -> list[float]:
    """What any correct scheduler must answer for `prompt` on an embedding StubWorker."""
    hidden = stub_hidden_states(prompt)
    pooled = {"last": hidden[-1], "cls": hidden[0], "mean": hidden.mean(0)}[method]
    return torch.nn.functional.normalize(pooled, dim=0).tolist()


def stub_prompt_logprob(prefix: list[int], target: int, vocab_size: int) -> float:
    """The stub's logprob of prompt token `target` after `prefix`: 0 for the token the stub
    would predict, lower the further the target's id is from it."""
    return -(abs(next_token(prefix, vocab_size) - target) % 1000) / 100


def prompt_logprobs_reference(prompt: list[int], start: int, vocab_size: int) -> list[tuple[float | None, int]]:
    """The input_token_logprobs a correct scheduler reports on a StubWorker (SGLang's shape)."""
    return [(None, prompt[start])] + [(stub_prompt_logprob(prompt[:i], prompt[i], vocab_size), prompt[i])
                                      for i in range(start + 1, len(prompt))]


class StubWorker:
    """Forwards in launch order on the executor; logprobs are `-rank/10` of fake top ids, and a
    prompt row's top ids start at the token the stub would predict there."""

    def __init__(
        self, num_rows: int, context_len: int, num_kv_slots: int, vocab_size: int, *, constant_token: int | None = None,
        pooler: Pooler | None = None,
    ) -> None:
        self.device = torch.device("cpu")
        self.vocab_size = vocab_size
        # constant_token: answer every request with it and skip the KV reads (the
        # scheduler-overhead benchmark times the scheduler, not this stub).
        self.constant_token = constant_token
        self.req_to_token = torch.zeros((num_rows, context_len), dtype=torch.int32)
        self.kv_tokens = torch.full((num_kv_slots + 1,), -1, dtype=torch.int64)
        self.futures: FutureMap | None = None
        self.pooler = pooler  # an embedding server's: answer pooled stub_hidden_states
        self.forwards = 0

    def attach_future_map(self, futures: FutureMap) -> None:
        self.futures = futures

    def launch(self, executor: Executor, mwb: ModelWorkerBatch) -> Future[BatchResult]:
        return executor.submit(self.forward, mwb)

    def close(self) -> None:
        pass

    def kv_buffers(self) -> list[torch.Tensor]:
        return [self.kv_tokens]

    @staticmethod
    def _upload(values: torch.Tensor | list[int], dtype: torch.dtype) -> torch.Tensor:
        return values.to(dtype) if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)

    def forward(self, mwb: ModelWorkerBatch) -> BatchResult:
        assert self.futures is not None, "attach_future_map first"
        self.forwards += 1
        bs = len(mwb.req_pool_indices)
        if self.constant_token is not None:  # no future is ever resolved: store nothing
            return BatchResult(next_token_ids=[self.constant_token] * bs)
        input_ids = self.futures.resolve(mwb.input_ids)
        assert bool((input_ids >= 0).all()), "an unresolved future id reached the forward"
        write_req_to_token(self.req_to_token, mwb, mwb.out_cache_loc, self._upload)
        self.kv_tokens[mwb.out_cache_loc] = input_ids
        tokens, hidden, prompt_lps, prompt_preds = [], [], [], []
        rows, start = iter(mwb.prompt_logprob_rows), 0
        row_at = next(rows, -1)
        targets = iter(mwb.prompt_logprob_targets)
        for row, seq_len, p, n in zip(mwb.req_pool_indices, mwb.seq_lens, mwb.extend_prefix_lens, mwb.extend_seq_lens):
            seq = self.kv_tokens[self.req_to_token[row, :seq_len].to(torch.int64)].tolist()
            assert -1 not in seq, f"row {row} reads a KV slot nothing wrote"
            if self.pooler is not None:
                hidden.append(stub_hidden_states(seq)[p:])
                continue
            tokens.append(next_token(seq, self.vocab_size))
            while start <= row_at < start + n:  # a prompt row of this request: position p + its offset
                prefix = seq[: p + row_at - start + 1]
                prompt_lps.append(stub_prompt_logprob(prefix, next(targets), self.vocab_size))
                prompt_preds.append(next_token(prefix, self.vocab_size))
                row_at = next(rows, -1)
            start += n
        if self.pooler is not None:
            partials = self.pooler.partials(torch.cat(hidden), torch.tensor(mwb.extend_seq_lens))
            return EmbeddingResult(next_token_ids=[], partials=partials)
        out = torch.tensor(tokens, dtype=torch.int64)
        self.futures.store(mwb.future_ids, out)
        result = BatchResult(next_token_ids=tokens)
        if mwb.prompt_logprob_rows:
            pk = mwb.prompt_top_k
            result.prompt_logprobs = prompt_lps
            result.prompt_top_logprobs = [[-j / 10 for j in range(pk)] for _ in prompt_preds]
            result.prompt_top_ids = [[(t + j) % self.vocab_size for j in range(pk)] for t in prompt_preds]
        if not mwb.return_logprob:
            return result
        k = max(max(mwb.top_logprobs_nums), 0)
        result.token_logprobs = [0.0] * bs
        result.top_logprobs = [[-j / 10 for j in range(k)] for _ in tokens]
        result.top_ids = [[t, *((t + j) % self.vocab_size for j in range(1, k))][:k] for t in tokens]
        return result
