"""Issue 22, finding 7: every flag of `train`, `regenerate` and `bench` is checked where it is parsed; a value out of
range (or a file where a directory belongs, an unreachable server) is one line on stderr and a nonzero exit, never
a ZeroDivisionError / IndexError deep inside, nor a silent run with a meaningless setting.

The commands run in process through `flashdraft.cli.main` (and the other entry points), so a refusal costs no
model load: the whole table runs in a few seconds."""

import json
import math

import pytest
import torch
from transformers import Qwen3ForCausalLM

from flashdraft.cli import main
from flashdraft.train.synthetic import MASK, tiny_target_config

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("flags")
    torch.manual_seed(0)
    Qwen3ForCausalLM(tiny_target_config(vocab_size=64, hidden_size=32, intermediate_size=64, heads=2, kv_heads=1,
                                        num_layers=2)).save_pretrained(root / "target")
    with open(root / "data.jsonl", "w") as f:
        for i in range(8):
            f.write(json.dumps({"input_ids": [1] + [4 + (i + k) % 50 for k in range(24)],
                                "loss_mask": [0] * 3 + [1] * 22}) + "\n")
    (root / "prompts.jsonl").write_text("".join(json.dumps({"input_ids": [1, 5 + i, 6 + i]}) + "\n" for i in range(4)))
    (root / "a_file").write_text("not a directory\n")
    return root


def _train(root, *flags):
    return ["train", "--target", str(root / "target"), "--data", str(root / "data.jsonl"), "--output-dir",
            str(root / "out-train"), "--block-size", "4", "--num-draft-layers", "1", "--mask-token-id", str(MASK),
            "--max-steps", "1", "--no-progress", "--no-eval-at-start", "--device", "cpu", *flags]


def _regenerate(root, *flags):
    return ["regenerate", "--target", str(root / "target"), "--data", str(root / "prompts.jsonl"), "--output-dir",
            str(root / "out-regen"), "--max-new-tokens", "4", "--no-progress", "--device", "cpu", *flags]


def _bench(root, *flags):
    return ["bench", "--output-dir", str(root / "out-bench"), "--no-plots", "--no-progress", *flags]


def _f(root, name):
    return str(root / name)


# (command builder, flags, text the one line must contain); `{root}` in a flag is the fixture directory
CASES = [
    # finding 7, as reported
    (_train, ["--batch-size", "0"], "--batch-size"),
    (_train, ["--grad-accum", "0"], "--grad-accum"),
    (_train, ["--save-every", "0"], "--save-every"),
    (_train, ["--block-size", "0"], "--block-size"),
    (_train, ["--block-size", "1"], "--block-size"),
    (_train, ["--max-steps", "-1"], "--max-steps"),
    (_train, ["--distill-weight", "5"], "--distill-weight"),
    (_train, ["--seed", str(2**64)], "--seed"),
    (_regenerate, ["--shard-size", "0"], "--shard-size"),
    (_regenerate, ["--limit", "-1"], "--limit"),
    (_regenerate, ["--max-new-tokens", "-1"], "--max-new-tokens"),
    (_regenerate, ["--seed", str(2**64)], "--seed"),
    (_bench, ["--num-prompts", "-1"], "--num-prompts"),
    (_bench, ["--server", "http://127.0.0.1:1"], "cannot connect"),
    (_bench, ["--seed", str(2**64)], "--seed"),
    # the same kind of mistake on the neighbouring flags
    (_train, ["--max-steps", "0"], "--max-steps"),
    (_train, ["--epochs", "0"], "--epochs"),
    (_train, ["--num-anchors", "0"], "--num-anchors"),
    (_train, ["--num-draft-layers", "0"], "--num-draft-layers"),
    (_train, ["--keep-checkpoints", "0"], "--keep-checkpoints"),
    (_train, ["--log-every", "0"], "--log-every"),
    (_train, ["--eval-every", "-1"], "--eval-every"),
    (_train, ["--eval-limit", "0"], "--eval-limit"),
    (_train, ["--max-length", "0"], "--max-length"),
    (_train, ["--lr", "nan"], "--lr"),
    (_train, ["--lr", "inf"], "--lr"),
    (_train, ["--lr", "-1e-3"], "--lr"),
    (_train, ["--grad-clip", "0"], "--grad-clip"),
    (_train, ["--warmup-ratio", "1.5"], "--warmup-ratio"),
    (_train, ["--distill-weight", "-0.1"], "--distill-weight"),
    (_train, ["--distill-temperature", "0"], "--distill-temperature"),
    (_train, ["--gamma", "0"], "--gamma"),
    (_train, ["--seed", "-1"], "--seed"),
    (_train, ["--mask-token-id", "-2"], "--mask-token-id"),
    (_train, ["--target-layer-ids", "1,x"], "--target-layer-ids"),
    (_train, ["--target-layer-ids", "-1"], "--target-layer-ids"),
    (_train, ["--device", "bogus"], "--device"),
    (_train, ["--output-dir", "{root}/a_file"], "is a file"),
    (_train, ["--feature-cache", "{root}/a_file"], "is a file"),
    (_train, ["--data", "{root}/missing.jsonl"], "no such file"),
    (_train, ["--eval-prompts", "./missing-prompts.jsonl"], "no such file"),
    (_train, ["--target", "{root}/a_file"], "is a file"),
    (_train, ["--target", "{root}/nowhere"], "no such directory"),
    (_regenerate, ["--batch-size", "0"], "--batch-size"),
    (_regenerate, ["--limit", "0"], "--limit"),
    (_regenerate, ["--temperature", "-1"], "--temperature"),
    (_regenerate, ["--top-p", "0"], "--top-p"),
    (_regenerate, ["--top-k", "-1"], "--top-k"),
    (_regenerate, ["--max-prompt-length", "0"], "--max-prompt-length"),
    (_regenerate, ["--output-dir", "{root}/a_file"], "is a file"),
    (_regenerate, ["--output-dir", "{root}/a_file/sub"], "is a file"),
    (_regenerate, ["--data", "{root}/missing.jsonl"], "no such file"),
    (_bench, ["--server", "ftp://example.org"], "--server"),
    (_bench, ["--server", "http://"], "--server"),
    (_bench, ["--server", "http://127.0.0.1:99999"], "--server"),
    (_bench, ["--output-dir", "{root}/a_file"], "is a file"),
    (_bench, ["--walk-candidates", "-1"], "--walk-candidates"),
]


def _id(case):
    build, flags, _ = case
    return build.__name__.strip("_") + ":" + "=".join(flags).replace("{root}/", "")


@pytest.mark.parametrize("build,flags,needle", CASES, ids=[_id(c) for c in CASES])
def test_flag_refused_in_one_line(files, capsys, build, flags, needle):
    argv = build(files, *[f.replace("{root}", str(files)) for f in flags])
    rc = main(argv)
    out, err = capsys.readouterr()
    assert rc != 0, (argv, out, err)
    assert "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1, err
    assert needle in err, (needle, err)
    assert not (files / "out-train" / "final").exists()


def test_train_cli_module_entry_point_refuses_too(files, capsys):
    """`python -m flashdraft.train.cli` (its `main`) parses with the same types."""
    from flashdraft.train.cli import main as train_main

    assert train_main(_train(files, "--batch-size", "0")) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "--batch-size" in err, err


def test_bench_entry_point_refuses_an_unreachable_server(files, capsys):
    from flashdraft.bench.cli import main as bench_main

    assert bench_main(_bench(files, "--server", "http://127.0.0.1:1")[1:]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "127.0.0.1:1" in err, err


def test_valid_flags_still_parse(files):
    """The checks refuse only what is out of range: the boundaries themselves are accepted."""
    from flashdraft.cli import build_parser

    parser = build_parser()
    args = parser.parse_args(_train(files, "--distill-weight", "1", "--warmup-ratio", "0", "--seed", str(2**32 - 1),
                                    "--eval-every", "0", "--lr", "0", "--block-size", "2", "--target-layer-ids", "0,1"))
    assert args.distill_weight == 1.0 and args.seed == 2**32 - 1 and args.target_layer_ids == [0, 1]
    args = parser.parse_args(_regenerate(files, "--limit", "1", "--shard-size", "1", "--temperature", "0"))
    assert args.limit == 1 and args.shard_size == 1
    args = parser.parse_args(_bench(files, "--server", "ar=http://localhost:8000/v1", "--num-prompts", "0"))
    assert args.server == ["ar=http://localhost:8000/v1"] and args.num_prompts == 0
    args = parser.parse_args(_train(files, "--data", "org/dataset-name"))  # a datasets name is not a path
    assert args.data == "org/dataset-name"


@pytest.mark.parametrize("field,value", [("batch_size", 0), ("grad_accum", 0), ("save_every", 0), ("block_size", 1),
                                         ("max_steps", -1), ("distill_weight", 5.0), ("seed", 2**64),
                                         ("lr", math.inf), ("epochs", 0)])
def test_train_config_is_checked_in_python_too(field, value):
    from flashdraft.train.trainer import TrainConfig, check_config

    with pytest.raises(ValueError, match=f"TrainConfig.{field}"):
        check_config(TrainConfig(**{field: value}))
    check_config(TrainConfig())


@pytest.mark.parametrize("kw", [{"shard_size": 0}, {"batch_size": 0}, {"max_new_tokens": -1}])
def test_regenerate_function_refuses_zero_sizes(tmp_path, kw):
    from flashdraft.train.regenerate import regenerate

    model = Qwen3ForCausalLM(tiny_target_config(vocab_size=64, hidden_size=32, intermediate_size=64, heads=2,
                                                kv_heads=1, num_layers=1)).eval()
    with pytest.raises(ValueError, match=next(iter(kw))):
        regenerate(model, [[1, 2, 3]], tmp_path / "r", progress=False, **kw)
    assert not list((tmp_path / "r").glob("shard-*"))


def test_vllm_speculative_config_stands_for_our_flags(capsys):
    """vLLM's `--speculative-config` JSON: its model, num_speculative_tokens and disable_by_batch_size become
    --draft, --block-size k + 1 and --speculative-disable-by-batch-size; a flag given as well must agree; anything
    else (another method, keys we do not read, wrong types, with --no-draft) is one line and exit 2."""
    from flashdraft.args import engine_config
    from flashdraft.cli import build_parser

    spec = {"method": "dflash", "model": "org/drafter", "num_speculative_tokens": 15, "disable_by_batch_size": 8}
    for command in (["serve"], ["demo"], ["generate", "--prompt", "x"]):
        args = build_parser().parse_args([*command, "--speculative-config", json.dumps(spec)])
        assert (args.draft, args.block_size, args.disable_by_batch_size) == ("org/drafter", 16, 8)
        assert engine_config(args).block_size == 16 and engine_config(args).disable_by_batch_size == 8
    agreeing = ["serve", "--draft", "org/drafter", "--block-size", "16", "--speculative-config", json.dumps(spec)]
    assert build_parser().parse_args(agreeing).block_size == 16
    assert build_parser().parse_args(["serve", "--speculative-config", '{"model": "m"}']).block_size is None
    refused = {'{"method": "ngram"}': "flashdraft drafts with DFlash drafters only",
               '{"model": "m", "prompt_lookup_max": 4}': "keys flashdraft does not read: prompt_lookup_max",
               "{method: dflash}": "not JSON", "[1]": "expected a JSON object",
               '{"num_speculative_tokens": "15"}': "num_speculative_tokens must be an integer",
               '{"num_speculative_tokens": 0}': "num_speculative_tokens must be >= 1",
               '{"disable_by_batch_size": true}': "disable_by_batch_size must be an integer"}
    for value, message in refused.items():
        assert main(["serve", "--speculative-config", value]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0], (value, err)
    conflicts = {("--draft", "other"): "--draft other and --speculative-config's model org/drafter differ",
                 ("--block-size", "8"): "--block-size 8 and --speculative-config's num_speculative_tokens 15",
                 ("--speculative-disable-by-batch-size", "4"): "disable_by_batch_size 8 differ",
                 ("--no-draft",): "--no-draft and --speculative-config contradict each other"}
    for flags, message in conflicts.items():
        assert main(["serve", *flags, "--speculative-config", json.dumps(spec)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0], (flags, err)
