"""The generation engine: `SpecEngine` (prefill + draft/verify cycles), the shared verifier, drafting methods."""

from flashdraft.engine import compat  # noqa: F401  (attaches DFlashDraftModel.spec_generate)
from flashdraft.engine.config import EngineConfig
from flashdraft.engine.generate import GenerationResult, RequestStats, SpecEngine, StreamEvent
from flashdraft.engine.proposers import DFlashProposer, NoProposer, NoRowState, ProposalInput
from flashdraft.engine.structured import StructuredOutput
from flashdraft.engine.verify import SamplingParams, Verdict, target_probs, verify

__all__ = [
    "DFlashProposer",
    "EngineConfig",
    "GenerationResult",
    "NoProposer",
    "NoRowState",
    "ProposalInput",
    "RequestStats",
    "SamplingParams",
    "SpecEngine",
    "StreamEvent",
    "StructuredOutput",
    "target_probs",
    "Verdict",
    "verify",
]
