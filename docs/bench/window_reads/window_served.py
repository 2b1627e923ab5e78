"""A served sliding-window target under a KV-cache memory budget: how many requests `flashdraft serve` runs at once
and how soon it serves them all, kept as run. `build DIR` writes a Gemma 3-shaped target (the shipped target's shape
and tokenizer, random weights, 3 of 4 layers sliding over 128 positions, fp32); `run URL OUT` sends `--requests`
prompts of about `--prompt` tokens (third-party source: transformers' own files) at once, `--new` tokens each, greedy,
polls the server's /metrics for `num_requests_running`, and writes the texts and figures to OUT (json); `compare A B`
prints two runs side by side (the same texts?).

    python docs/bench/window_reads/window_served.py build /tmp/g3
    flashdraft serve --target /tmp/g3 --no-draft --kv-cache-memory 0.018 --port 8124 &
    python docs/bench/window_reads/window_served.py run http://127.0.0.1:8124 /tmp/after.json
"""
import argparse, concurrent.futures as cf, json, re, shutil, sys, threading, time
from pathlib import Path

import httpx
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
SHIPPED = Path(__file__).resolve().parents[3] / "flashdraft/assets/default_pair/target"


def build(out: str) -> None:
    from window_reads import random_model

    _, model = random_model("gemma3")
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(4.0)  # sharper random logits: fewer near-ties
    model.save_pretrained(out)
    for f in SHIPPED.iterdir():
        if "token" in f.name or f.name.endswith(".jinja"):
            shutil.copy(f, out)


def prompts(n: int, tokens: int) -> list[str]:
    import transformers
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(SHIPPED))
    files = sorted(Path(transformers.__file__).parent.glob("models/*/modeling_*.py"))
    out = []
    for f in files:
        ids = tok(f.read_text())["input_ids"]
        if len(ids) > tokens + 16:
            out.append(tok.decode(ids[:tokens]))
        if len(out) == n:
            return out
    raise SystemExit("not enough source files")


def run(url: str, out: str, n: int, tokens: int, new: int) -> None:
    texts, most, done = [None] * n, [0], threading.Event()

    def poll():
        while not done.is_set():
            metrics = httpx.get(f"{url}/metrics", timeout=10).text
            found = re.search(r"^\S*num_requests_running\S* (\S+)$", metrics, re.M)
            most[0] = max(most[0], int(float(found.group(1))) if found else 0)
            time.sleep(0.05)

    model = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]

    def ask(i_prompt):
        i, prompt = i_prompt
        body = {"model": model, "prompt": prompt, "max_tokens": new, "temperature": 0, "ignore_eos": True}
        resp = httpx.post(f"{url}/v1/completions", json=body, timeout=900)
        resp.raise_for_status()
        texts[i] = resp.json()["choices"][0]["text"]

    batch = prompts(n, tokens)
    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    started = time.perf_counter()
    with cf.ThreadPoolExecutor(n) as pool:
        list(pool.map(ask, enumerate(batch)))
    seconds = time.perf_counter() - started
    done.set()
    poller.join()
    result = {"requests": n, "prompt_tokens": tokens, "new": new, "most_running": most[0], "seconds": seconds,
              "texts": texts}
    Path(out).write_text(json.dumps(result))
    print(f"{n} requests of ~{tokens} tokens x {new}: at most {most[0]} running, {seconds:.1f} s")


def compare(a: str, b: str) -> None:
    ra, rb = json.loads(Path(a).read_text()), json.loads(Path(b).read_text())
    print(f"| | most running | seconds |\n|---|---|---|\n| {a} | {ra['most_running']} | {ra['seconds']:.1f} |\n"
          f"| {b} | {rb['most_running']} | {rb['seconds']:.1f} |\n\n{b} / {a} seconds: "
          f"{rb['seconds'] / ra['seconds']:.2f}x; same texts: {sum(x == y for x, y in zip(ra['texts'], rb['texts']))}"
          f" / {len(ra['texts'])}")


def main():
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="command", required=True)
    sub.add_parser("build").add_argument("out")
    r = sub.add_parser("run")
    r.add_argument("url")
    r.add_argument("out")
    r.add_argument("--requests", type=int, default=16)
    r.add_argument("--prompt", type=int, default=1024)
    r.add_argument("--new", type=int, default=64)
    c = sub.add_parser("compare")
    c.add_argument("a")
    c.add_argument("b")
    args = ap.parse_args()
    if args.command == "build":
        build(args.out)
    elif args.command == "run":
        run(args.url, args.out, args.requests, args.prompt, args.new)
    else:
        compare(args.a, args.b)


if __name__ == "__main__":
    main()
