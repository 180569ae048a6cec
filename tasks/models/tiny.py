"""A tiny, deterministic Flux pipeline built offline from real diffusers/transformers classes.

Used by tests and smoke runs: same architecture and code paths as FLUX.1-dev, but a few hundred
kB on disk, so everything runs on CPU in seconds with no Hugging Face hub access.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from pathlib import Path

import torch
from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
from tokenizers import pre_tokenizers
from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizerFast, T5Config, T5EncoderModel, T5TokenizerFast

DEFAULT_ARCH: dict = {
    # FluxTransformer2DModel (guidance_embeds=True, like flux-dev)
    "num_layers": 1, "num_single_layers": 1, "attention_head_dim": 16, "num_attention_heads": 2,
    "axes_dims_rope": (4, 6, 6),  # must sum to attention_head_dim
    # AutoencoderKL: 4 blocks -> vae_scale_factor 8, as in real Flux
    "latent_channels": 4, "vae_block_out_channels": (8, 16, 16, 16), "vae_layers_per_block": 1,
    "vae_norm_num_groups": 8,
    # CLIPTextModel (its hidden size is the transformer's pooled_projection_dim)
    "clip_hidden_size": 32, "clip_layers": 2, "clip_heads": 2, "clip_intermediate_size": 37,
    "clip_num_merges": 300,
    # T5EncoderModel (its d_model is the transformer's joint_attention_dim)
    "t5_d_model": 32, "t5_d_kv": 8, "t5_d_ff": 37, "t5_layers": 2, "t5_heads": 4,
    "t5_max_length": 32,
}

# Small built-in corpus for training the tokenizers offline.
_WORDS = """
the be to of and a in that have i it for not on with he as you do at this but his by from they we say
her she or an will my one all would there their what so up out if about who get which go me when make
can like time no just him know take people into year your good some could them see other than then now
look only come its over think also back after use two how our work first well way even new want because
any these give day most us is are was were been has had did does made said went got came thing man woman
child world life hand part place case week point house home water room mother area money story fact month
lot right study book eye job word business issue side kind head far black long both little own old big
high different small large next early young important few public bad same able red blue green yellow
orange purple pink brown white grey gray cyan magenta gold silver dark light bright pale circle square
triangle star heart diamond hexagon rectangle oval line dot stripe stripes striped grid checker pattern
shape shapes photo photograph picture image painting drawing sketch render illustration portrait
background foreground center centre left top bottom corner middle edge border frame inside outside
above below near under between around behind front zero three four five six seven eight nine ten
eleven twelve twenty hundred thousand many several single double pair group row column style art
artist digital sharp soft smooth rough flat solid empty full round tall short wide narrow thin thick
tiny huge simple plain detailed clean cat dog bird fish tree flower sky sun moon cloud mountain river
sea city street car road table chair cup window door wall floor light shadow color colour texture
""".split()
_COLOURS = "red blue green yellow orange purple pink white black grey".split()
_SHAPES = "circle square triangle star heart diamond stripes dots".split()


def corpus() -> list[str]:
    """Deterministic lines: the word list plus templated captions like the ones we train on."""
    lines = [" ".join(_WORDS[i : i + 12]) for i in range(0, len(_WORDS), 12)]
    lines += [
        f"a photo of a {c} {s} on a {b} background" for c in _COLOURS for s in _SHAPES for b in _COLOURS if b != c
    ]
    lines += [f"{n} {s}s, {n} {c} shapes" for n in range(0, 21) for s in _SHAPES[:3] for c in _COLOURS[:3]]
    return lines


def learn_bpe(word_counts: Counter, num_merges: int, suffix: str = "</w>") -> list[tuple[str, str]]:
    """Plain BPE merge learning with ties broken by pair, so the result is reproducible
    (tokenizers' BpeTrainer/UnigramTrainer break ties in hash order: different files every run).
    `suffix` marks a word's last symbol (CLIP's "</w>"; "" for GPT-2/Qwen byte-level BPE)."""
    seqs = {w: tuple(w[:-1]) + (w[-1] + suffix,) for w in sorted(word_counts)}
    merges = []
    for _ in range(num_merges):
        pairs = Counter()
        for w, s in seqs.items():
            for pair in zip(s, s[1:]):
                pairs[pair] += word_counts[w]
        if not pairs:
            break
        best = min(pairs, key=lambda p: (-pairs[p], p))
        merges.append(best)
        for w, s in seqs.items():
            out, i = [], 0
            while i < len(s):
                step = 2 if s[i : i + 2] == best else 1
                out.append("".join(s[i : i + step]))
                i += step
            seqs[w] = tuple(out)
    return merges


def clip_tokenizer(num_merges: int) -> CLIPTokenizerFast:
    """Byte-level BPE with CLIP's pre-processing and vocab layout (bytes, bytes</w>, merges, specials)."""
    backend = CLIPTokenizerFast().backend_tokenizer  # empty vocab; gives us CLIP's exact pre-processing
    words = Counter(
        piece for line in corpus()
        for piece, _ in backend.pre_tokenizer.pre_tokenize_str(backend.normalizer.normalize_str(line))
    )
    merges = learn_bpe(words, num_merges)
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    # Every byte both word-internal and word-final, so any text tokenizes without <unk>, like real CLIP.
    tokens = alphabet + [c + "</w>" for c in alphabet] + ["".join(m) for m in merges]
    tokens += ["<|startoftext|>", "<|endoftext|>"]  # specials last, as in CLIP (eos = highest id)
    vocab = {t: i for i, t in enumerate(dict.fromkeys(tokens))}
    return CLIPTokenizerFast(vocab=vocab, merges=merges, model_max_length=77)


def t5_tokenizer(max_length: int) -> T5TokenizerFast:
    """Sentencepiece-style Unigram with T5's special ids (<pad>=0, </s>=1, <unk>=2): whole corpus words
    scored by log-frequency, plus every printable ASCII char as a low-score fallback."""
    words = Counter(w for line in corpus() for w in re.findall(r"[a-z0-9]+", line))
    total = sum(words.values())
    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0)]
    pieces += [("\u2581" + w, round(math.log(n / total), 4)) for w, n in sorted(words.items())]
    fallback = round(math.log(1 / total) - 5.0, 4)
    pieces += [(c, fallback) for c in ["\u2581"] + [chr(i) for i in range(33, 127)]]
    return T5TokenizerFast(vocab=pieces, extra_ids=0, model_max_length=max_length)


def build_tiny_flux(out_dir: str | Path, seed: int = 0, arch: dict | None = None) -> Path:
    """Build a tiny random-weight Flux pipeline and save it in diffusers layout under `out_dir`.

    Weights depend only on `seed` (same seed -> byte-identical files); the global torch RNG of the
    caller is left untouched. `arch` overrides keys of `DEFAULT_ARCH` (transformer: num_layers,
    num_single_layers, attention_head_dim, num_attention_heads, axes_dims_rope; VAE: latent_channels,
    vae_block_out_channels, vae_layers_per_block, vae_norm_num_groups; CLIP: clip_hidden_size,
    clip_layers, clip_heads, clip_intermediate_size, clip_num_merges; T5: t5_d_model, t5_d_kv, t5_d_ff,
    t5_layers, t5_heads, t5_max_length). Load with `FluxPipeline.from_pretrained(out_dir)`
    and call it with `max_sequence_length=a["t5_max_length"]` (32 by default), height/width 64.
    """
    unknown = set(arch or {}) - set(DEFAULT_ARCH)
    if unknown:
        raise ValueError(f"unknown arch keys: {sorted(unknown)}")
    a = {**DEFAULT_ARCH, **(arch or {})}
    out_dir = Path(out_dir)
    tokenizer, tokenizer_2 = clip_tokenizer(a["clip_num_merges"]), t5_tokenizer(a["t5_max_length"])

    # One seed per component, drawn from a generator seeded with `seed`: changing one component's
    # sizes does not change the others' weights. fork_rng keeps the caller's global RNG intact.
    component_seeds = torch.randint(0, 2**31 - 1, (4,), generator=torch.Generator().manual_seed(seed)).tolist()

    def seeded(i: int, build):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(component_seeds[i])
            return build()

    transformer = seeded(0, lambda: FluxTransformer2DModel(
        patch_size=1, in_channels=4 * a["latent_channels"],  # 2x2 latent patches packed into channels
        num_layers=a["num_layers"], num_single_layers=a["num_single_layers"],
        attention_head_dim=a["attention_head_dim"], num_attention_heads=a["num_attention_heads"],
        joint_attention_dim=a["t5_d_model"], pooled_projection_dim=a["clip_hidden_size"],
        guidance_embeds=True, axes_dims_rope=tuple(a["axes_dims_rope"]),
    ))
    n_blocks = len(a["vae_block_out_channels"])
    vae = seeded(1, lambda: AutoencoderKL(
        in_channels=3, out_channels=3, latent_channels=a["latent_channels"],
        down_block_types=("DownEncoderBlock2D",) * n_blocks, up_block_types=("UpDecoderBlock2D",) * n_blocks,
        block_out_channels=tuple(a["vae_block_out_channels"]), layers_per_block=a["vae_layers_per_block"],
        norm_num_groups=a["vae_norm_num_groups"], sample_size=64,
        scaling_factor=0.3611, shift_factor=0.1159,  # FLUX.1 VAE values
        use_quant_conv=False, use_post_quant_conv=False,  # Flux's VAE has neither
    ))
    text_encoder = seeded(2, lambda: CLIPTextModel(CLIPTextConfig(
        vocab_size=len(tokenizer), hidden_size=a["clip_hidden_size"], intermediate_size=a["clip_intermediate_size"],
        num_hidden_layers=a["clip_layers"], num_attention_heads=a["clip_heads"], max_position_embeddings=77,
        projection_dim=a["clip_hidden_size"],
        # the pooled output is taken at the first eos token, so the ids must match the tokenizer's
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )))
    text_encoder_2 = seeded(3, lambda: T5EncoderModel(T5Config(
        vocab_size=len(tokenizer_2), d_model=a["t5_d_model"], d_kv=a["t5_d_kv"], d_ff=a["t5_d_ff"],
        num_layers=a["t5_layers"], num_heads=a["t5_heads"], feed_forward_proj="gated-gelu",  # T5 v1.1, as in Flux
        pad_token_id=0, eos_token_id=1, decoder_start_token_id=0,
    )))
    scheduler = FlowMatchEulerDiscreteScheduler(  # FLUX.1-dev scheduler config
        num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True,
        base_shift=0.5, max_shift=1.15, base_image_seq_len=256, max_image_seq_len=4096,
    )
    pipe = FluxPipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                        text_encoder_2=text_encoder_2, tokenizer_2=tokenizer_2, transformer=transformer)
    pipe.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


def build_tiny_flux_kontext(out_dir: str | Path, seed: int = 0, arch: dict | None = None) -> Path:
    """The tiny Flux of `build_tiny_flux` as a FLUX.1 Kontext pipeline folder: Kontext has FLUX.1's components
    and architecture (its transformer learns to read the control image's tokens), so only the pipeline class
    in model_index.json differs. Load with `FluxKontextPipeline.from_pretrained(out_dir)`."""
    import json

    out_dir = build_tiny_flux(out_dir, seed=seed, arch=arch)
    index = out_dir / "model_index.json"
    index.write_text(json.dumps({**json.loads(index.read_text()), "_class_name": "FluxKontextPipeline"}, indent=2))
    return out_dir
