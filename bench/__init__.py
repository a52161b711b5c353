"""Benchmark tools (`sluice bench ...`) and their recorded results (RESULTS.md).

- serving.py           HTTP client against a running server (SGLang's bench_serving layout):
                       its arguments; serving_client.py the requests and a run,
                       serving_compare.py the same requests against a llama-server
- offline.py           the same datasets through the in-process Engine, optionally vs HF
- compare_hf.py        HF transformers `generate` on exactly the same requests
- one_batch.py         one static batch: prefill latency, decode step latency
- scheduler_overhead.py  the real Scheduler with a stub forward: CPU time per round
- chunked_itl.py       inter-token latency of running streams while a long prompt arrives
"""
