"""How often a screened race could skip most of the noise (issue 18): the race argmax z / T + G over the vocabulary,
G = -log E the noise, can only be won by a token whose z / T + 17.33 (the largest G the 24-bit draws allow, -log
2^-25) beats the best of the M most probable tokens; where the (M+1)-th logit fails that, the noise of the rest need
not be made. Counts, over the shipped target's own sampled continuations (16 prompts x 64 tokens, in-domain and
out of domain), the share of positions where M candidates certify the winner, at T = 1, 0.7, 0.5.

    python docs/bench/noise_screening/certified_share.py
"""
import torch, math
from transformers import AutoModelForCausalLM, AutoTokenizer
from flashdraft.bench.datasets import load_prompts
torch.set_num_threads(1)
torch.manual_seed(0)
P = "flashdraft/assets/default_pair/target"
m = AutoModelForCausalLM.from_pretrained(P).eval(); tok = AutoTokenizer.from_pretrained(P)
GMAX = -math.log(2.0 ** -25)  # largest -log E
logits_all = []
for spec in ("default", "ood-code"):
    for pr in load_prompts(spec, 8):
        ids = torch.tensor([pr.encode(tok, False)])
        out = m.generate(ids, max_new_tokens=64, do_sample=True, temperature=1.0)
        with torch.no_grad():
            logits_all.append(m(out).logits[0, ids.shape[1]-1:].float())
z = torch.cat(logits_all)
print("positions", z.shape[0])
g = torch.Generator().manual_seed(0)
for T in (1.0, 0.7, 0.5):
    s = z / T
    G = -torch.log(-torch.log(torch.rand(s.shape, generator=g)))
    for M in (64, 256, 1024):
        top = s.topk(M + 1, -1)
        best = (top.values[:, :M] + G.gather(-1, top.indices[:, :M])).max(-1).values
        cert = (top.values[:, M] + GMAX < best).float().mean()
        print(f"T {T} M {M}: certified {cert:.3f}")
