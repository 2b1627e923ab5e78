import torch

# Tiny models are dominated by per-op overhead; more threads only add contention on small CI machines.
torch.set_num_threads(1)
