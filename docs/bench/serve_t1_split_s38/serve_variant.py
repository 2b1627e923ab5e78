"""Throwaway probe (BENCHMARKS, 'The served temperature-1 cost, split'): `flashdraft serve` with one change.

    VARIANT=never python serve_variant.py serve --port 8103 --threads 1 --max-batch-size 32
    VARIANT=prior PRIOR=0.37 python serve_variant.py serve --port 8104 --threads 1 --max-batch-size 64

never: the drafting engine, every batch planned by a policy that always answers width 1 (the features are still
tapped and kept for the drafter: what drafting costs where it never drafts). prior: sampled rows start from
PRIOR per draft position instead of the optimistic 0.9. Any other VARIANT: `flashdraft serve` as shipped.
"""
import os
import sys

from flashdraft.engine.generate import SpecEngine

variant = os.environ.get("VARIANT", "")
if variant == "never":
    class NeverDraft:
        def new_row(self, sampled=False):
            return None

        def widths(self, rows, pending=None):
            return [1] * len(rows)

        def observe(self, rows, widths, accepted, timing):
            pass

    new_batch = SpecEngine._new_batch

    def _new_batch(self, **fields):
        batch = new_batch(self, **fields)
        if self.proposer.needs_features:
            batch.policy = NeverDraft()
        return batch

    SpecEngine._new_batch = _new_batch
if variant == "prior":
    import numpy as np

    from flashdraft.engine import policy

    init = policy.AcceptancePriors.__init__

    def __init__(self, block_size):
        init(self, block_size)
        self.by_kind[True] = np.full(block_size - 1, float(os.environ.get("PRIOR", "0.37")))

    policy.AcceptancePriors.__init__ = __init__

from flashdraft.cli import main  # noqa: E402

sys.exit(main(sys.argv[1:]))
