"""What the tiny builders share: the offline tokenizers (a fixed-vocabulary BPE learnt deterministically from a
small built-in corpus: tokenizers' own trainers are not deterministic), the VAE and CLIP towers of the SD-style
families, `resolve_arch` and `seeder`.

Every builder of this package follows the same conventions: weights depend only on `seed` (same seed -> byte-identical
files), the caller's global torch RNG is untouched, `arch` overrides keys of the family's `*_ARCH` defaults (unknown
key -> ValueError), and dimensions that must agree between components are derived, not separate arch keys."""
from __future__ import annotations

import math
import re
from collections import Counter

import torch
from diffusers import AutoencoderKL
from tokenizers import pre_tokenizers
from transformers import CLIPTextConfig, CLIPTokenizerFast, Qwen2Tokenizer, T5TokenizerFast


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


def qwen_bpe_tokenizer(num_merges: int, lines: list[str], specials: list[str], chat_template: str) -> Qwen2Tokenizer:
    """Byte-level BPE learnt on `lines` with Qwen2's pre-tokenizer (GPT-2 style, no end-of-word marker), the
    `specials` after it (the first, <|endoftext|>, is pad/unk; eos <|im_end|>, the end of a chat turn) and a
    chat template: the Qwen tokenizers of Z-Image, FLUX.2 [klein] and Qwen-Image (Qwen2.5-VL)."""
    backend = Qwen2Tokenizer(vocab={"<|endoftext|>": 0}, merges=[]).backend_tokenizer  # Qwen's pre-processing
    words = Counter(piece for line in lines
                    for piece, _ in backend.pre_tokenizer.pre_tokenize_str(backend.normalizer.normalize_str(line)))
    merges = learn_bpe(words, num_merges, suffix="")
    tokens = sorted(pre_tokenizers.ByteLevel.alphabet()) + ["".join(m) for m in merges] + specials
    vocab = {t: i for i, t in enumerate(dict.fromkeys(tokens))}
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=merges, model_max_length=32768, padding_side="right",
                               eos_token="<|im_end|>", additional_special_tokens=specials[1:])
    tokenizer.chat_template = chat_template
    return tokenizer


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


# Shared by all three families: AutoencoderKL with 4 blocks (vae_scale_factor 8, like the real models)
# and the CLIP text tower(s). CLIP layers >= 2 because SD3/SDXL read the penultimate hidden state.
VAE_ARCH = {"latent_channels": 4, "vae_block_out_channels": (8, 16, 16, 16), "vae_layers_per_block": 1,
             "vae_norm_num_groups": 8}


CLIP_ARCH = {"clip_hidden_size": 32, "clip_layers": 2, "clip_heads": 2, "clip_intermediate_size": 37,
              "clip_num_merges": 300}


def resolve_arch(defaults: dict, arch: dict | None) -> dict:
    unknown = set(arch or {}) - set(defaults)
    if unknown:
        raise ValueError(f"unknown arch keys: {sorted(unknown)}")
    return {**defaults, **(arch or {})}


def seeder(seed: int, n: int):
    """Returns `seeded(i, build)`: runs `build` under component i's own seed (so resizing one component
    leaves the others' weights alone), inside fork_rng so the caller's global RNG is untouched."""
    seeds = torch.randint(0, 2**31 - 1, (n,), generator=torch.Generator().manual_seed(seed)).tolist()

    def seeded(i: int, build):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seeds[i])
            return build()
    return seeded


def make_vae(a: dict, scaling_factor: float, shift_factor: float | None = None, quant_conv: bool = True) -> AutoencoderKL:
    n = len(a["vae_block_out_channels"])
    return AutoencoderKL(
        in_channels=3, out_channels=3, latent_channels=a["latent_channels"],
        down_block_types=("DownEncoderBlock2D",) * n, up_block_types=("UpDecoderBlock2D",) * n,
        block_out_channels=tuple(a["vae_block_out_channels"]), layers_per_block=a["vae_layers_per_block"],
        norm_num_groups=a["vae_norm_num_groups"], sample_size=64, scaling_factor=scaling_factor,
        shift_factor=shift_factor, use_quant_conv=quant_conv, use_post_quant_conv=quant_conv,
    )


def make_clip(cls, a: dict, tokenizer, hidden_size: int, projection_dim: int):
    return cls(CLIPTextConfig(
        vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=a["clip_intermediate_size"],
        num_hidden_layers=a["clip_layers"], num_attention_heads=a["clip_heads"], max_position_embeddings=77,
        projection_dim=projection_dim,
        # the pooled output is taken at the first eos token, so the ids must match the tokenizer's
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    ))


def clip_tokenizer_2(a: dict):
    """SDXL's and SD3's second CLIP tokenizer pads with "!" (id of a byte token), not with <|endoftext|>."""
    tokenizer = clip_tokenizer(a["clip_num_merges"])
    tokenizer.pad_token = "!"
    return tokenizer


def sd_betas() -> dict:
    """The SD1.x / SDXL training noise schedule."""
    return dict(num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
                steps_offset=1)
