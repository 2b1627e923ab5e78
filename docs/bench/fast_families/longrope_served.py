"""Served LongRoPE requests crossing the original length against the target's own greedy `generate` (kept as run):
8 held-out prompts sent at once to a running `flashdraft serve` of the pair `longrope_demo_pair.py` builds, 150
tokens each (prompt + 150 > the pair's original length, 160), each text compared with `generate`'s.

    python docs/bench/fast_families/longrope_demo_pair.py /tmp/phi4tiny
    flashdraft serve --target /tmp/phi4tiny/target --draft /tmp/phi4tiny/drafter --port 8123 &
    python docs/bench/fast_families/longrope_served.py /tmp/phi4tiny http://127.0.0.1:8123
"""
import concurrent.futures as cf
import sys

import httpx
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from flashdraft.demo import load_heldout_prompts

pair, url = sys.argv[1], sys.argv[2]
tok = AutoTokenizer.from_pretrained(f"{pair}/target")
model = AutoModelForCausalLM.from_pretrained(f"{pair}/target", dtype=torch.float32).eval()
prompts = load_heldout_prompts()[:8]


def ask(prompt: str) -> str:
    body = {"model": "target", "prompt": prompt, "max_tokens": 150, "temperature": 0, "ignore_eos": True}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=300).json()["choices"][0]["text"]


with cf.ThreadPoolExecutor(len(prompts)) as pool:
    texts = list(pool.map(ask, prompts))
same = 0
for prompt, text in zip(prompts, texts):
    ids = tok(prompt, return_tensors="pt")["input_ids"]
    reference = model.generate(ids, max_new_tokens=150, min_new_tokens=150, do_sample=False)[0, ids.shape[1]:]
    same += text == tok.decode(reference)
print(f"served ({len(prompts)} at once, 150 tokens each): {same} / {len(prompts)} equal to the target's generate")
