"""Released DFlash checkpoints come in variants; each one here is a fixture written the way such a checkpoint
writes it (config.json + weight names + side files), and is either loaded with the semantics vLLM's
`qwen3_dflash.py` gives it or refused with an error naming the field (docs/checkpoints.md, 'Variants').

Loaded variants are checked three ways: the resolved per-layer semantics (window, causality, RoPE layout, taps),
the draft hidden states / logits against an independent implementation (the self-contained `dflash.py` that our
export writes, run here under our transformers, loading our re-export of the variant), and where it matters a whole
lossless generation through our engine with the same acceptance lengths as `dflash.py`'s own loop.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from flashdraft import CheckpointError, DFlashDraftModel, SamplingParams, SpecEngine, default_target_layer_ids
from flashdraft.model.remote_code import dflash as remote
from tiny import MASK_ID, VOCAB, greedy_reference, make_target

H, HEADS, KV, HD, INTER = 32, 4, 2, 8, 48
N_LAYERS = 2


@pytest.fixture(scope="module")
def target():
    return make_target("qwen3")


def base_layout(target_config, num_layers=N_LAYERS, hidden=H, target_hidden=H, seed=0, block_size=4):
    """A drafter in the reference (z-lab hub) layout: config dict + float32 state dict, random weights."""
    layer_ids = default_target_layer_ids(target_config.num_hidden_layers, num_layers)
    config = {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "attention_bias": False,
        "attention_dropout": 0.0, "head_dim": HD, "hidden_act": "silu", "hidden_size": hidden,
        "intermediate_size": INTER, "max_position_embeddings": 512, "num_attention_heads": HEADS,
        "num_hidden_layers": num_layers, "num_key_value_heads": KV,
        "num_target_layers": target_config.num_hidden_layers, "rms_norm_eps": 1e-6, "rope_scaling": None,
        "rope_theta": 1000000.0, "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "float32",
        "use_sliding_window": False, "vocab_size": target_config.vocab_size, "block_size": block_size,
        "dflash_config": {"mask_token_id": MASK_ID, "target_layer_ids": layer_ids},
    }
    g = torch.Generator().manual_seed(seed)
    w = lambda *shape: torch.randn(*shape, generator=g) * 0.2  # noqa: E731
    norm = lambda n: 1 + 0.1 * torch.randn(n, generator=g)  # noqa: E731
    state = {"fc.weight": w(hidden, len(layer_ids) * target_hidden), "hidden_norm.weight": norm(hidden),
             "norm.weight": norm(hidden)}
    for i in range(num_layers):
        p = f"layers.{i}."
        state |= {
            p + "self_attn.q_proj.weight": w(HEADS * HD, hidden), p + "self_attn.k_proj.weight": w(KV * HD, hidden),
            p + "self_attn.v_proj.weight": w(KV * HD, hidden), p + "self_attn.o_proj.weight": w(hidden, HEADS * HD),
            p + "self_attn.q_norm.weight": norm(HD), p + "self_attn.k_norm.weight": norm(HD),
            p + "mlp.gate_proj.weight": w(INTER, hidden), p + "mlp.up_proj.weight": w(INTER, hidden),
            p + "mlp.down_proj.weight": w(hidden, INTER),
            p + "input_layernorm.weight": norm(hidden), p + "post_attention_layernorm.weight": norm(hidden),
        }
    return config, state


def write(directory, config, state, **files):
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    save_file({k: v.contiguous() for k, v in state.items()}, str(directory / "model.safetensors"),
              metadata={"format": "pt"})
    for name, obj in files.items():
        torch.save(obj, directory / name.replace("__", "."))
    return directory


def load(directory):
    return DFlashDraftModel.from_pretrained(directory, dtype=torch.float64)


def layers(drafter):
    return [(l.self_attn.sliding_window, l.self_attn.is_causal) for l in drafter.layers]


def same_as_remote(drafter, target, tmp_path, ctx_len=13):
    """Our drafter's hidden states and logits equal those of the exported `dflash.py` on our re-export."""
    export = drafter.save_pretrained(tmp_path / "reexport", dtype=torch.float64)
    theirs = remote.DFlashDraftModel.from_pretrained(str(export), dtype=torch.float64).eval()
    torch.manual_seed(0)
    n_in = len(drafter.target_layer_ids) * drafter.target_hidden_size
    feats = torch.randn(1, ctx_len, n_in, dtype=torch.float64)
    ctx_pos = torch.arange(ctx_len)[None]
    block = torch.full((1, drafter.block_size), drafter.mask_token_id)
    block[0, 0] = 7
    pos = torch.arange(ctx_len, ctx_len + drafter.block_size)[None]
    with torch.no_grad():
        ours = drafter(drafter.embed(block, target.get_input_embeddings().weight), pos, feats, ctx_pos)
        cache = {"k": [None] * len(theirs.layers), "v": [None] * len(theirs.layers), "pos": None}
        theirs.write_context(cache, feats, ctx_pos)
        ref = theirs(theirs.embed(block, target), pos, cache)
        torch.testing.assert_close(ours, ref, rtol=1e-9, atol=1e-9)
        logits = drafter.compute_logits(ours, target.get_output_embeddings())
        torch.testing.assert_close(logits, theirs.compute_logits(ref, target), rtol=1e-9, atol=1e-9)
    return ours, logits


def generation_matches_remote(drafter, target, tmp_path, prompt=(3, 14, 15, 92, 65, 35), n=24):
    """Lossless through our engine, and cycle-by-cycle acceptance lengths equal to `dflash.py`'s own loop."""
    export = drafter.save_pretrained(tmp_path / "gen", dtype=torch.float64)
    theirs = remote.DFlashDraftModel.from_pretrained(str(export), dtype=torch.float64).eval()
    res = theirs.spec_generate(target, torch.tensor([list(prompt)]), n, return_stats=True)
    engine = SpecEngine(target, drafter, draft_policy="fixed", lookup_splice=0)  # their loop: the drafter's chain
    ours = engine.generate([list(prompt)], SamplingParams(max_new_tokens=n))[0]
    assert ours.token_ids == res.output_ids[0, len(prompt):].tolist() == greedy_reference(target, list(prompt), n)
    assert ours.stats.acceptance_lengths[:-1] == res.acceptance_lengths[:-1]


# ---- variants that load -------------------------------------------------------------------------------------------


def test_reference_layout_rope_base_is_read(target, tmp_path):
    config, state = base_layout(target.config)
    d = load(write(tmp_path / "v", config, state))
    assert d.rotary_emb.inv_freq[1].item() == pytest.approx(1e6 ** (-2 / HD))
    assert layers(d) == [(None, False)] * N_LAYERS
    same_as_remote(d, target, tmp_path)


def test_mixed_layer_types_sliding_layers_are_causal(target, tmp_path):
    """z-lab/gemma-4-31B-it-DFlash style: sliding and full layers; a sliding layer is causal inside the block
    (vLLM, z-lab's package), a full one bidirectional. The window survives although use_sliding_window is absent."""
    config, state = base_layout(target.config)
    config.update(layer_types=["sliding_attention", "full_attention"], sliding_window=3)
    del config["use_sliding_window"]
    d = load(write(tmp_path / "v", config, state))
    assert layers(d) == [(3, True), (None, False)]
    ours, _ = same_as_remote(d, target, tmp_path)
    config["is_causal"] = False  # explicit: overrides the per-layer default -> a different result
    other = load(write(tmp_path / "v2", config, state))
    assert layers(other) == [(3, False), (None, False)]
    other_hidden, _ = same_as_remote(other, target, tmp_path / "o")
    assert (other_hidden - ours).abs().max() > 1e-6
    saved = json.loads((tmp_path / "o" / "reexport" / "config.json").read_text())
    assert saved["use_sliding_window"] is True and saved["is_causal"] is False


def test_use_swa_and_swa_window_size(target, tmp_path):
    """XiaomiMiMo ...-DFlash style: dflash_config.use_swa with swa_window_size over all-full layer_types: every
    layer slides with that window and stays non-causal (vLLM)."""
    config, state = base_layout(target.config)
    config.update(layer_types=["full_attention"] * N_LAYERS)
    config["dflash_config"].update(use_swa=True, swa_window_size=5)
    d = load(write(tmp_path / "v", config, state))
    assert layers(d) == [(5, False)] * N_LAYERS
    same_as_remote(d, target, tmp_path)


def test_dflash_config_causal(target, tmp_path):
    config, state = base_layout(target.config)
    config["dflash_config"]["causal"] = True
    d = load(write(tmp_path / "v", config, state))
    assert layers(d) == [(None, True)] * N_LAYERS
    same_as_remote(d, target, tmp_path)
    saved = json.loads((tmp_path / "reexport" / "config.json").read_text())
    assert saved["is_causal"] is True  # z-lab's package reads only is_causal: the export spells it out


@pytest.mark.parametrize("style", ["dflash_config", "top_level"])
def test_attention_sink_bias(target, tmp_path, style):
    config, state = base_layout(target.config)
    if style == "dflash_config":
        config["dflash_config"]["attention_sink_bias"] = True
    else:  # MiMo's top-level spelling, vLLM's fallback
        config["add_swa_attention_sink_bias"] = True
    for i in range(N_LAYERS):
        state[f"layers.{i}.self_attn.attention_sink_bias"] = torch.linspace(-1.0, 2.0, HEADS) + i
    d = load(write(tmp_path / "v", config, state))
    assert all(l.self_attn.attention_sink_bias is not None for l in d.layers)
    with_sinks, _ = same_as_remote(d, target, tmp_path)
    for layer in d.layers:
        layer.self_attn.attention_sink_bias.data.fill_(-1e4)  # a sink that takes no mass = no sink
    no_sink, _ = same_as_remote(d, target, tmp_path / "no_sink")
    assert torch.isfinite(no_sink).all() and (with_sinks - no_sink).abs().max() > 1e-6


def test_interleaved_rope(target, tmp_path):
    config, state = base_layout(target.config)
    config["is_neox_style"] = False
    d = load(write(tmp_path / "v", config, state))
    assert all(l.self_attn.interleaved for l in d.layers)
    interleaved, _ = same_as_remote(d, target, tmp_path)
    config["is_neox_style"] = True
    neox, _ = same_as_remote(load(write(tmp_path / "n", config, state)), target, tmp_path / "n2")
    assert (interleaved - neox).abs().max() > 1e-6
    x = torch.randn(1, 1, 3, HD, dtype=torch.float64)  # a rotation: norms kept
    cos, sin = d.rotary_emb(x, torch.arange(3)[None])
    from flashdraft.model.drafter import apply_rope

    torch.testing.assert_close(apply_rope(x, cos, sin, True).norm(dim=-1), x.norm(dim=-1))


def test_transformers_assistant_layout(target, tmp_path):
    """transformers' own DFlash assistant (`muse_glimmer_assistant`): DFlash fields at top level, no vocab_size,
    `encoder.fc` / `encoder.output_norm_enc`, every layer bidirectional. Equal to transformers' own model."""
    config, state = base_layout(target.config)
    layer_ids = config["dflash_config"]["target_layer_ids"]
    muse = {
        "architectures": ["MuseGlimmerAssistantModel"], "model_type": "muse_glimmer_assistant", "block_size": 4,
        "attention_dropout": 0, "dtype": "float32", "head_dim": HD, "hidden_act": "silu", "hidden_size": H,
        "intermediate_size": INTER, "layer_types": ["sliding_attention"] * N_LAYERS, "mask_token_id": MASK_ID,
        "max_position_embeddings": 512, "num_attention_heads": HEADS, "num_hidden_layers": N_LAYERS,
        "num_key_value_heads": KV, "rms_norm_eps": 1e-6, "sliding_window": 6,
        "rope_parameters": {"rope_theta": 500000.0, "rope_type": "default"}, "target_layer_ids": layer_ids,
        "bos_token_id": None, "eos_token_id": None, "pad_token_id": None,
    }
    renamed = {{"fc.weight": "encoder.fc.weight", "hidden_norm.weight": "encoder.output_norm_enc.weight"}.get(k, k): v
               for k, v in state.items()}
    directory = write(tmp_path / "v", muse, renamed)
    d = load(directory)
    # its window is inclusive (|q - k| <= 6): 7 in our (vLLM's) exclusive convention
    assert layers(d) == [(7, False)] * N_LAYERS and d.target_layer_ids == layer_ids
    assert d.rotary_emb.inv_freq[1].item() == pytest.approx(5e5 ** (-2 / HD))
    SpecEngine(target, d)  # pairs: no vocab_size to check
    ours, _ = same_as_remote(d, target, tmp_path)
    import transformers

    transformers_dflash = getattr(transformers, "MuseGlimmerAssistantModel", None)
    if transformers_dflash is not None:
        theirs = transformers_dflash.from_pretrained(str(directory), dtype=torch.float64,
                                                     attn_implementation="sdpa").eval()
        torch.manual_seed(0)
        feats = torch.randn(1, 13, 2 * H, dtype=torch.float64)
        block = torch.full((1, 4), MASK_ID)
        block[0, 0] = 7
        noise = d.embed(block, target.get_input_embeddings().weight)
        from transformers.cache_utils import DFlashCache

        cache = DFlashCache(config=theirs.config)  # as transformers' DFlash loop calls it (the mask needs the cache)
        cache.set_previous_accepted_tokens(13)
        with torch.no_grad():
            hf = theirs(noise_embeds=noise, context_hidden_states=feats, position_ids=torch.arange(17)[None],
                        past_key_values=cache).last_hidden_state
        torch.testing.assert_close(ours, hf, rtol=1e-9, atol=1e-9)


def test_encoder_names_in_a_dflash_config(target, tmp_path):
    config, state = base_layout(target.config)
    state = {{"fc.weight": "encoder.fc.weight", "hidden_norm.weight": "encoder.output_norm_enc.weight"}.get(k, k): v
             for k, v in state.items()}
    state = {("model." + k if k.startswith("layers.") else k): v for k, v in state.items()}
    d = load(write(tmp_path / "v", config, state))
    torch.testing.assert_close(d.fc.weight, state["encoder.fc.weight"].double())


@pytest.mark.parametrize("where", ["top_level", "eagle_config"])
def test_eagle_aux_layer_ids(target, tmp_path, where):
    """EAGLE-3 numbering (id L = output of target layer L-1): `eagle_aux_hidden_state_layer_ids` at top level, or
    `eagle_config.layer_ids`; our taps are L - 1 (vLLM adds 1 to DFlash ids for the same capture)."""
    config, state = base_layout(target.config)
    ids = config["dflash_config"].pop("target_layer_ids")
    if where == "top_level":
        config["eagle_aux_hidden_state_layer_ids"] = [i + 1 for i in ids]
    else:
        config["eagle_config"] = {"layer_ids": [i + 1 for i in ids], "use_aux_hidden_state": True}
    d = load(write(tmp_path / "v", config, state))
    assert d.target_layer_ids == ids
    saved = json.loads((d.save_pretrained(tmp_path / "re") / "config.json").read_text())
    assert saved["dflash_config"]["target_layer_ids"] == ids


def test_target_hidden_size_with_own_embedding_and_lm_head(target, tmp_path):
    """A drafter narrower than its target (`target_hidden_size`): fc reads the target's width, the block is
    embedded and read out with the drafter's own embed_tokens / lm_head. Lossless through our engine."""
    config, state = base_layout(target.config, hidden=16, target_hidden=H)
    config.update(target_hidden_size=H, head_dim=4)
    g = torch.Generator().manual_seed(3)
    for i in range(N_LAYERS):
        p = f"layers.{i}.self_attn."
        state[p + "q_proj.weight"] = torch.randn(HEADS * 4, 16, generator=g) * 0.2
        state[p + "k_proj.weight"] = torch.randn(KV * 4, 16, generator=g) * 0.2
        state[p + "v_proj.weight"] = torch.randn(KV * 4, 16, generator=g) * 0.2
        state[p + "o_proj.weight"] = torch.randn(16, HEADS * 4, generator=g) * 0.2
        state[p + "q_norm.weight"], state[p + "k_norm.weight"] = torch.ones(4), torch.ones(4)
    state["embed_tokens.weight"] = torch.randn(VOCAB, 16, generator=g)
    state["lm_head.weight"] = torch.randn(VOCAB, 16, generator=g)
    d = load(write(tmp_path / "v", config, state))
    assert d.fc.in_features == 2 * H and d.embed_tokens is not None and d.lm_head is not None
    same_as_remote(d, target, tmp_path)
    generation_matches_remote(d, target, tmp_path)


def test_mask_embedding_file(target, tmp_path):
    """MiMo style: a separately trained mask embedding in `mask_embedding.pt` replaces the mask token's row."""
    config, state = base_layout(target.config)
    emb = torch.randn(H)
    d = load(write(tmp_path / "v", config, state, mask_embedding__pt={"mask_token_id": MASK_ID, "embedding": emb}))
    block = torch.tensor([[5, MASK_ID, MASK_ID]])
    out = d.embed(block, target.get_input_embeddings().weight)
    torch.testing.assert_close(out[0, 1], emb.double())
    torch.testing.assert_close(out[0, 0], target.get_input_embeddings().weight[5])
    same_as_remote(d, target, tmp_path)
    assert (tmp_path / "reexport" / "mask_embedding.pt").is_file()  # written for vLLM, which reads that file
    d2 = load(write(tmp_path / "bare", config, state, mask_embedding__pt=emb))  # a bare tensor works too
    torch.testing.assert_close(d2.mask_embedding, emb.double())


def test_reduced_draft_vocabulary_with_d2t(target, tmp_path):
    """EAGLE-3 style reduced vocabulary: `draft_vocab_size`, own lm_head over it, `d2t` offsets (draft id d is
    target id d + d2t[d]), `t2d` ignored; logits scattered to the target vocabulary, -inf elsewhere (vLLM)."""
    config, state = base_layout(target.config)
    dv = 40
    config["draft_vocab_size"] = dv
    kept = torch.sort(torch.randperm(VOCAB, generator=torch.Generator().manual_seed(1))[:dv]).values
    state["lm_head.weight"] = torch.randn(dv, H, generator=torch.Generator().manual_seed(2))
    state["d2t"] = kept - torch.arange(dv)
    state["t2d"] = torch.zeros(VOCAB, dtype=torch.bool).index_fill(0, kept, True)
    d = load(write(tmp_path / "v", config, state))
    _, logits = same_as_remote(d, target, tmp_path)
    assert logits.shape[-1] == VOCAB
    assert torch.isinf(logits[..., [i for i in range(VOCAB) if i not in set(kept.tolist())]]).all()
    assert set(logits.argmax(-1).flatten().tolist()) <= set(kept.tolist())
    generation_matches_remote(d, target, tmp_path)


def test_logit_scale(target, tmp_path):
    config, state = base_layout(target.config)
    config["logit_scale"] = 0.25
    d = load(write(tmp_path / "v", config, state))
    h = torch.randn(1, 3, H, dtype=torch.float64)
    torch.testing.assert_close(d.compute_logits(h, target.get_output_embeddings()),
                               0.25 * target.get_output_embeddings()(h))
    same_as_remote(d, target, tmp_path)


def test_midlayer_name(target, tmp_path):
    config, state = base_layout(target.config, num_layers=1)
    state = {k.replace("layers.0.", "midlayer."): v for k, v in state.items()}
    assert load(write(tmp_path / "v", config, state)).layers[0].mlp.up_proj.weight.shape == (INTER, H)


def test_multimodal_target_pairs_and_is_lossless(tmp_path):
    """z-lab's drafters for multimodal targets: the target config nests the language model in `text_config`
    (here a Llava with a Qwen3 text model). Pairing reads the text config, taps the language model's layers."""
    from transformers import CLIPVisionConfig, LlavaConfig, LlavaForConditionalGeneration, Qwen3Config

    text = Qwen3Config(vocab_size=VOCAB, hidden_size=H, intermediate_size=64, num_hidden_layers=5,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=512,
                       rope_parameters={"rope_type": "default", "rope_theta": 1e6}, tie_word_embeddings=False)
    vision = CLIPVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                              image_size=16, patch_size=8)
    torch.manual_seed(0)
    mm = LlavaForConditionalGeneration(LlavaConfig(text_config=text, vision_config=vision))
    with torch.no_grad():
        mm.get_output_embeddings().weight.mul_(4.0)
    mm = mm.double().eval()
    config, state = base_layout(text)
    d = load(write(tmp_path / "v", config, state))
    prompt = [3, 14, 15, 92, 65, 35]
    engine = SpecEngine(mm, d)
    assert engine.fast is not None  # the language model inside runs the fast path
    out = engine.generate([prompt], SamplingParams(max_new_tokens=16))[0]
    ref = mm.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False, pad_token_id=0,
                      attention_mask=torch.ones(1, len(prompt), dtype=torch.long))[0, len(prompt):].tolist()
    assert out.token_ids == ref
    from flashdraft import make_draft_config

    made = make_draft_config(mm.config, num_layers=2, mask_token_id=MASK_ID)
    assert made.num_target_layers == 5 and made.hidden_size == H and made.rope_parameters["rope_theta"] == 1e6


# ---- variants that are refused, naming the field ------------------------------------------------------------------


def _refused(tmp_path, target, match, mutate=None, state_mutate=None, **files):
    config, state = base_layout(target.config)
    if mutate:
        mutate(config)
    if state_mutate:
        state_mutate(state)
    with pytest.raises(CheckpointError, match=match):
        load(write(tmp_path / "r", config, state, **files))


def test_refused_variants(target, tmp_path):
    ids = default_target_layer_ids(target.config.num_hidden_layers, N_LAYERS)
    _refused(tmp_path / "1", target, "eagle_aux_hidden_state_layer_ids.*contradicts target_layer_ids",
             lambda c: c.update(eagle_aux_hidden_state_layer_ids=[i + 2 for i in ids]))
    _refused(tmp_path / "2", target, "taps layer id 0",
             lambda c: (c["dflash_config"].pop("target_layer_ids"), c.update(eagle_aux_hidden_state_layer_ids=[0, 3])))
    _refused(tmp_path / "3", target, "use_aux_hidden_state=false",
             lambda c: c["dflash_config"].update(use_aux_hidden_state=False))
    _refused(tmp_path / "4", target, "DFlash2DraftModel", lambda c: c.update(architectures=["DFlash2DraftModel"]))
    _refused(tmp_path / "5", target, "mask_hidden", state_mutate=lambda s: s.update(mask_hidden=torch.zeros(H)))
    _refused(tmp_path / "6", target, "draft_vocab_size 40 != vocab_size .* own lm_head",
             lambda c: c.update(draft_vocab_size=40))
    _refused(tmp_path / "7", target, "missing \\['d2t'\\]", lambda c: c.update(draft_vocab_size=40),
             lambda s: s.update({"lm_head.weight": torch.zeros(40, H)}))
    _refused(tmp_path / "8", target, "target_hidden_size 48 differs .* no embed_tokens",
             lambda c: c.update(target_hidden_size=48))
    _refused(tmp_path / "9", target, "mask_token_id 3 does not match",
             mask_embedding__pt={"mask_token_id": 3, "embedding": torch.zeros(H)})
    _refused(tmp_path / "10", target, "sliding_attention layers need a window",
             lambda c: c.update(layer_types=["sliding_attention"] * N_LAYERS, sliding_window=None))
    _refused(tmp_path / "11", target, "partial_rotary_factor",
             lambda c: c.update(rope_parameters={"rope_type": "default", "rope_theta": 1e6,
                                                 "partial_rotary_factor": 0.5}))
    _refused(tmp_path / "12", target, "layer_types entry 'chunked_attention'",
             lambda c: c.update(layer_types=["chunked_attention", "full_attention"]))


def test_transformers_assistant_export_refuses_what_it_cannot_state(target, tmp_path):
    from flashdraft.model.hf_export import to_transformers_assistant

    config, state = base_layout(target.config)
    config.update(layer_types=["sliding_attention", "full_attention"], sliding_window=3)
    with pytest.raises(ValueError, match="causal layers"):
        to_transformers_assistant(load(write(tmp_path / "v", config, state)))


def test_export_is_readable_by_every_reader(target, tmp_path):
    """The written config carries both rope spellings, both dtype spellings, auto_map + dflash.py, and reloads to
    the same model in ours."""
    config, state = base_layout(target.config)
    config["rope_theta"] = 1e6
    d = load(write(tmp_path / "v", config, state))
    out = d.save_pretrained(tmp_path / "e", dtype=torch.bfloat16)
    saved = json.loads((out / "config.json").read_text())
    assert saved["rope_theta"] == 1e6 and saved["rope_scaling"] is None
    assert saved["rope_parameters"] == {"rope_type": "default", "rope_theta": 1e6}
    assert saved["torch_dtype"] == saved["dtype"] == "bfloat16"
    assert saved["auto_map"] == {"AutoModel": "dflash.DFlashDraftModel"} and (out / "dflash.py").is_file()
    keys = set(load_file(str(out / "model.safetensors")))
    assert keys == set(state)
    again = DFlashDraftModel.from_pretrained(out)
    assert again.rotary_emb.inv_freq[1].item() == pytest.approx(1e6 ** (-2 / HD))
