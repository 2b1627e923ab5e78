"""The reference implementation's one-call API, `drafter.spec_generate(target, input_ids, ...)`, on our engine.

The model package never imports the engine (the engine imports the model); this module attaches the reference's
drop-in method to `DFlashDraftModel` when the engine package is imported, which `import flashdraft` (and so any
import of a flashdraft module) always does.

What this module does not know about: anything the engine does not expose through `SpecEngine.generate`.
"""

from __future__ import annotations

import torch
from torch import nn

from flashdraft.engine.generate import SpecEngine
from flashdraft.engine.verify import SamplingParams
from flashdraft.model.drafter import DFlashDraftModel


@torch.inference_mode()
def spec_generate(
    drafter: DFlashDraftModel,
    target: nn.Module,
    input_ids: torch.LongTensor,
    max_new_tokens: int,
    stop_token_ids: list[int] | None,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
) -> torch.LongTensor:
    """Drop-in for the reference: returns `[1, prompt + generated]` token ids (generation ends after a stop id)."""
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                            stop_token_ids=tuple(stop_token_ids or ()))
    rows = [ids for ids in input_ids.tolist()]
    with SpecEngine(target, drafter) as engine:  # one engine per call: its hooks come off the target after it
        results = engine.generate(rows, params)
    if len(results) == 1:
        return torch.tensor([rows[0] + results[0].token_ids], dtype=torch.long, device=input_ids.device)
    return [torch.tensor([r + res.token_ids], device=input_ids.device) for r, res in zip(rows, results)]


DFlashDraftModel.spec_generate = spec_generate
