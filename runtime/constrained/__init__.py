"""Structured output (`--grammar-backend xgrammar`): JSON schemas, regexes and EBNF
grammars compiled off the event loop, and per-request matchers whose token bitmasks
the sampler applies to the logits (SGLang's `constrained/`).

Threads: compilation runs on the backend's pool; a request's `Grammar` is created by
the scheduler and from then on advanced only by the worker thread, in forward order
(`Grammar.fill` before sampling, `Grammar.accept` after). The scheduler never touches
a matcher: what it must change (a token the worker sampled but the scheduler dropped,
a first token a prefill server sampled) it queues with `accept_later`/`rollback_later`,
applied by the worker before its next use.
"""

from runtime.constrained.grammar import Grammar, GrammarBackend, InvalidGrammar

__all__ = ["Grammar", "GrammarBackend", "InvalidGrammar"]
