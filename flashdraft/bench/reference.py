"""The reference every losslessness check compares with: the target's own greedy `generate` from transformers,
on its own unpacked weights (none of our fast path, caches or packed kernels), and the token-by-token comparison
of one of our outputs with it.

What this module does not know about: our engine (it compares finished results) and sampling (token-by-token
equality is a greedy notion; sampled output is checked statistically in the tests).
"""

from __future__ import annotations

TARGET_GENERATE = "the target's own greedy generate (transformers, unpacked weights)"
TIE_NOTE = ("floating-point near-ties between a multi-token verify and one-token steps can cause this; "
            "see the README for the measured rate")


def target_greedy_generate(target, prompt_ids: list[int], params, grammars=None) -> list[int]:
    """The target's own greedy continuation: transformers' `generate(do_sample=False)` through the model's own
    forward on its own (unpacked) weights, none of our fast path, caches or packed kernels. It runs under a clean
    generation config (no penalties or other defaults from the checkpoint's generation_config.json) with our stop
    ids as its EOS ids and our max_new_tokens, and is cut after the first stop id, as our engine stops. A structured
    output (`params.structured`) masks each step through `grammars` (the engine's `GrammarCompiler`); `min_tokens`
    is transformers' `min_new_tokens`; bad words mask as vLLM reads them (`OutputBadWords`)."""
    import torch
    from transformers import GenerationConfig

    stops = list(params.stop_token_ids)
    pad = stops[0] if stops else (target.config.pad_token_id if target.config.pad_token_id is not None else 0)
    ids = torch.tensor([list(prompt_ids)], dtype=torch.long, device=target.device)
    extra = {"min_new_tokens": params.min_tokens} if params.min_tokens and stops else {}
    processors = []
    if params.structured is not None:
        from flashdraft.engine.structured import GrammarLogitsProcessor

        processors.append(GrammarLogitsProcessor(grammars.matcher(params.structured), len(prompt_ids)))
    if params.bad_words:
        processors.append(OutputBadWords(params.bad_words, len(prompt_ids)))
    if processors:
        from transformers import LogitsProcessorList

        extra["logits_processor"] = LogitsProcessorList(processors)
    saved = target.generation_config
    target.generation_config = GenerationConfig(do_sample=False, num_beams=1, eos_token_id=stops or None,
                                                pad_token_id=pad)
    try:
        with torch.inference_mode():
            out = target.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, num_beams=1,
                                  max_new_tokens=params.max_new_tokens, eos_token_id=stops or None,
                                  pad_token_id=pad, **extra)
    finally:
        target.generation_config = saved
    tokens = out[0, len(prompt_ids):].tolist()
    for i, t in enumerate(tokens):
        if t in stops:
            return tokens[:i + 1]
    return tokens


class OutputBadWords:
    """A transformers logits processor for `SamplingParams.bad_words` as vLLM reads them: a word's last token is
    -inf where the output so far (after `prompt_len` prompt tokens, which do not count) ends in its other tokens.
    transformers' own `bad_words_ids` reads the prompt too."""

    def __init__(self, words: tuple[tuple[int, ...], ...], prompt_len: int):
        self.words, self.prompt_len = words, prompt_len

    def __call__(self, input_ids, scores):
        output = tuple(input_ids[0, self.prompt_len:].tolist())
        for word in self.words:
            k = len(word) - 1
            if k <= len(output) and output[len(output) - k:] == word[:-1]:
                scores[:, word[-1]] = float("-inf")
        return scores


def compare_with_target(target, prompt_ids: list[int], params, result, grammars=None) -> dict:
    """Our greedy output against `target_greedy_generate`, token for token, up to the same stop.

    An output cut by a stop string is compared with the same number of the target's tokens (transformers is not
    asked to apply stop strings). Returns {"identical", "tokens", "target_tokens", "first_difference_at"}."""
    ours = list(result.token_ids)
    ref = target_greedy_generate(target, prompt_ids, params, grammars)
    stopped_by_string = (result.finish_reason == "stop" and params.stop_strings
                         and not (ours and ours[-1] in params.stop_token_ids))
    if stopped_by_string:
        ref = ref[:len(ours)]
    first = first_difference(ours, ref)
    return {"identical": first is None, "tokens": len(ours), "target_tokens": len(ref), "first_difference_at": first,
            "ours_at_difference": ours[first] if first is not None and first < len(ours) else None,
            "target_at_difference": ref[first] if first is not None and first < len(ref) else None}


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first position where two token lists differ (the shorter one's length if one extends the other);
    None when they are equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def describe_difference(check: dict) -> str:
    j = check["first_difference_at"]
    return (f"first difference at token {j} (ours {check['ours_at_difference']}, target "
            f"{check['target_at_difference']}; {check['tokens']} vs {check['target_tokens']} tokens)")


