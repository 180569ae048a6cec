"""A tiny, deterministic FLUX.2 [dev] pipeline (`Flux2Pipeline`: Mistral Small 3.1 text encoder), built offline
from real diffusers/transformers classes. Conventions of common.py: weights depend only on `seed`,
the caller's RNG is untouched, `arch` overrides keys of `FLUX2_DEV_ARCH`.

The text encoder is a `Mistral3ForConditionalGeneration` (a Mistral text model and a one-layer Pixtral vision
tower that FLUX.2 never runs). The real checkpoint's `tokenizer` folder is a `PixtralProcessor`, which needs
torchvision (not installed beside this torch); the pipeline only calls its `apply_chat_template`, which a
plain tokenizer has too, so the tiny model stores a tokenizer: byte-level BPE in Tekken's layout (Mistral's
special tokens at their ids: <unk> 0, <s> 1, </s> 2, [INST] 3, [/INST] 4, [IMG] 10, <pad> 11,
[SYSTEM_PROMPT] 17, [/SYSTEM_PROMPT] 18), a tiktoken-style split, and Mistral Small 3.1's chat template
(system block, then user turns; text blocks of list contents)."""
from __future__ import annotations

from collections import Counter
from pathlib import Path

from diffusers.pipelines.flux2.system_messages import SYSTEM_MESSAGE
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from tasks.models.tiny.common import corpus, learn_bpe
from tasks.models.tiny.common import resolve_arch, seeder
from tasks.models.tiny.tiny_flux2 import FLUX2_ARCH, flux2_image_parts

MISTRAL_SPECIALS = ["<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
                    "[TOOL_RESULTS]", "[/TOOL_RESULTS]", "[TOOL_CALLS]", "[IMG]", "<pad>", "[IMG_BREAK]",
                    "[IMG_END]", "[PREFIX]", "[MIDDLE]", "[SUFFIX]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]",
                    "[TOOL_CONTENT]"]
# Tekken's pre-tokenizer split (tiktoken style: letters with their leading space, single digits, punctuation)
_SPLIT = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|"
          r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}|"
          r" ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# Mistral Small 3.1's template for what Flux2Pipeline renders (a system message, one user turn; contents as
# strings or lists of text/image blocks), without the default dated system message it never uses.
MISTRAL31_CHAT_TEMPLATE = (
    "{{- bos_token }}{%- set text = namespace(s='') %}"
    "{%- for message in messages %}"
    "{%- if message['content'] is string %}{%- set text.s = message['content'] %}"
    "{%- else %}{%- set text.s = '' %}{%- for block in message['content'] %}"
    "{%- if block['type'] == 'text' %}{%- set text.s = text.s + block['text'] %}"
    "{%- elif block['type'] in ['image', 'image_url'] %}{%- set text.s = text.s + '[IMG]' %}{%- endif %}"
    "{%- endfor %}{%- endif %}"
    "{%- if message['role'] == 'system' %}{{- '[SYSTEM_PROMPT]' + text.s + '[/SYSTEM_PROMPT]' }}"
    "{%- elif message['role'] == 'user' %}{{- '[INST]' + text.s + '[/INST]' }}"
    "{%- elif message['role'] == 'assistant' %}{{- text.s + eos_token }}"
    "{%- else %}{{- raise_exception('Only user, system and assistant roles are supported!') }}{%- endif %}"
    "{%- endfor %}"
)

FLUX2_DEV_ARCH: dict = {
    # Flux2Transformer2DModel and AutoencoderKLFlux2 as for [klein] (FLUX2_ARCH), with the guidance embedding
    # [dev] has; joint_attention_dim = 3 x mistral_hidden_size (hidden states 10, 20 and 30, stacked)
    **{k: v for k, v in FLUX2_ARCH.items() if not k.startswith("qwen_")},
    # Mistral3ForConditionalGeneration's text model: 31 layers, so hidden state 30 is a layer's output before
    # the final norm, as in Mistral Small 3.1 (40 layers)
    "mistral_hidden_size": 16, "mistral_layers": 31, "mistral_heads": 2, "mistral_kv_heads": 1,
    "mistral_head_dim": 8, "mistral_intermediate_size": 16, "mistral_num_merges": 400,
}


def mistral_tokenizer(num_merges: int) -> PreTrainedTokenizerFast:
    pre = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(_SPLIT), behavior="isolated"),
                                   pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    # FLUX.2's system message weighted in: its words become single tokens, as with the real vocabulary, so it
    # takes ~40 of the window's tokens and leaves the rest to the caption
    lines = corpus() + [SYSTEM_MESSAGE] * 40
    words = Counter(piece for line in lines for piece, _ in pre.pre_tokenize_str(line))
    merges = learn_bpe(words, num_merges, suffix="")
    tokens = MISTRAL_SPECIALS + sorted(pre_tokenizers.ByteLevel.alphabet()) + ["".join(m) for m in merges]
    backend = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(dict.fromkeys(tokens))}, merges=merges))
    backend.pre_tokenizer, backend.decoder = pre, decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                        pad_token="<pad>", additional_special_tokens=MISTRAL_SPECIALS[3:],
                                        model_max_length=131072, padding_side="right")
    tokenizer.chat_template = MISTRAL31_CHAT_TEMPLATE
    return tokenizer


def build_tiny_flux2_dev(out_dir: str | Path, seed: int = 0, arch: dict | None = None) -> Path:
    """Tiny random-weight `Flux2Pipeline` (FLUX.2 [dev] layout) saved in diffusers layout under `out_dir`.
    Images are multiples of 16 px; call with e.g. height/width 64 and `max_sequence_length=64` (the system
    message takes 40 of them)."""
    from diffusers import Flux2Pipeline
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration

    a = resolve_arch(FLUX2_DEV_ARCH, arch)
    tokenizer = mistral_tokenizer(a["mistral_num_merges"])
    seeded = seeder(seed, 4)
    transformer, vae, scheduler = flux2_image_parts(a, seeded, 3 * a["mistral_hidden_size"], guidance_embeds=True)
    ids = dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
               pad_token_id=tokenizer.pad_token_id)
    text_encoder = seeded(2, lambda: Mistral3ForConditionalGeneration(Mistral3Config(
        text_config=dict(model_type="mistral", vocab_size=len(tokenizer), hidden_size=a["mistral_hidden_size"],
                         intermediate_size=a["mistral_intermediate_size"], num_hidden_layers=a["mistral_layers"],
                         num_attention_heads=a["mistral_heads"], num_key_value_heads=a["mistral_kv_heads"],
                         head_dim=a["mistral_head_dim"], max_position_embeddings=2048, rms_norm_eps=1e-5,
                         rope_theta=1000000000.0, sliding_window=None, **ids),  # Mistral Small 3.1's rope_theta
        vision_config=dict(model_type="pixtral", hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                           intermediate_size=16, image_size=32, patch_size=8, num_channels=3, head_dim=8),
        image_token_index=tokenizer.convert_tokens_to_ids("[IMG]"), spatial_merge_size=2,
        tie_word_embeddings=False, **ids,
    )))
    pipe = Flux2Pipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                         transformer=transformer)
    out_dir = Path(out_dir)
    pipe.save_pretrained(out_dir, safe_serialization=True)
    return out_dir

# The learning check's settings for this module's tiny models (bench/learns.py; bench/learns_settings.py gathers
# every family's): the tiny model's width (model.arch) and the run that memorises one image or clip, each choice's
# measured reason beside it. Chosen to reach the bound in about 3 min or less on 2 cores.
LEARNS = {"tiny_flux2_dev": {"arch": {"num_attention_heads": 8, "num_layers": 2, "num_single_layers": 2},
                              "rank": 16, "steps": 300, "lr": 1e-2}}
