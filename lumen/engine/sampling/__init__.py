"""Sampling: a request's logits row -> its next token, the same in the offline API and the server.

    params.py      SamplingParams: every per-request option, checked once (ranges, combinations)
    processors.py  logits processors applied first: repetition, frequency and presence penalties
    sampler.py     the sampler chain (top-k -> top-p -> min-p -> temperature) and the keyed uniforms that make
                   a draw depend only on (seed, position, use), so batching and speculation keep the bits
    logprobs.py    the log-probabilities of given tokens under rows of logits (a prompt's: prompt_logprobs)
"""
