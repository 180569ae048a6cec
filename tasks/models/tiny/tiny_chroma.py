"""A tiny, deterministic Chroma pipeline built offline from real diffusers/transformers classes: ChromaTransformer2DModel
(FLUX.1-schnell's double and single blocks, their modulation from the small approximator
`distilled_guidance_layer`), the FLUX.1 AutoencoderKL and a T5 v1.1 encoder with the offline T5 tokenizer
(conventions: tasks/models/tiny/common.py)."""
from __future__ import annotations

from pathlib import Path

from diffusers import ChromaPipeline, ChromaTransformer2DModel, FlowMatchEulerDiscreteScheduler
from transformers import T5Config, T5EncoderModel

from tasks.models.tiny.common import VAE_ARCH, make_vae, resolve_arch, seeder, t5_tokenizer

CHROMA_ARCH: dict = {
    # ChromaTransformer2DModel; axes_dims_rope sums to attention_head_dim
    "num_layers": 1, "num_single_layers": 1, "attention_head_dim": 16, "num_attention_heads": 2,
    "axes_dims_rope": (4, 6, 6),
    # the approximator: its input is the released model's 64 channels (16 timestep + 16 guidance + 32 of the
    # modulation index), a narrow hidden width and 2 of its 5 layers
    "approximator_num_channels": 64, "approximator_hidden_dim": 32, "approximator_layers": 2,
    **VAE_ARCH,
    # T5EncoderModel (its d_model is the transformer's joint_attention_dim)
    "t5_d_model": 32, "t5_d_kv": 8, "t5_d_ff": 37, "t5_layers": 2, "t5_heads": 4, "t5_max_length": 32,
}


def build_tiny_chroma(out_dir: str | Path, seed: int = 0, arch: dict | None = None) -> Path:
    """Tiny random-weight `ChromaPipeline` saved in diffusers layout under `out_dir` (same seed -> the same bytes).

    Keys of `CHROMA_ARCH`: transformer (num_layers, num_single_layers, attention_head_dim, num_attention_heads,
    axes_dims_rope, approximator_*), VAE (latent_channels, vae_*: /8 like FLUX.1's), T5 (t5_*). Images are
    multiples of 16 px (VAE /8, then 2x2 patches); call with e.g. height/width 64 and `max_sequence_length=32`."""
    a = resolve_arch(CHROMA_ARCH, arch)
    tokenizer = t5_tokenizer(a["t5_max_length"])
    seeded = seeder(seed, 3)
    transformer = seeded(0, lambda: ChromaTransformer2DModel(
        patch_size=1, in_channels=4 * a["latent_channels"],  # 2x2 latent patches packed into channels
        num_layers=a["num_layers"], num_single_layers=a["num_single_layers"],
        attention_head_dim=a["attention_head_dim"], num_attention_heads=a["num_attention_heads"],
        joint_attention_dim=a["t5_d_model"], axes_dims_rope=tuple(a["axes_dims_rope"]),
        approximator_num_channels=a["approximator_num_channels"],
        approximator_hidden_dim=a["approximator_hidden_dim"], approximator_layers=a["approximator_layers"],
    ))
    # the FLUX.1 VAE's scale and shift (Chroma1-HD's vae/config.json is FLUX.1's), no quant convs
    vae = seeded(1, lambda: make_vae(a, scaling_factor=0.3611, shift_factor=0.1159, quant_conv=False))
    text_encoder = seeded(2, lambda: T5EncoderModel(T5Config(
        vocab_size=len(tokenizer), d_model=a["t5_d_model"], d_kv=a["t5_d_kv"], d_ff=a["t5_d_ff"],
        num_layers=a["t5_layers"], num_heads=a["t5_heads"], feed_forward_proj="gated-gelu",  # T5 v1.1
        pad_token_id=0, eos_token_id=1, decoder_start_token_id=0,
    )))
    # FLUX.1-dev's dynamic-shift schedule: ChromaPipeline passes mu from the image's sequence length (ai-toolkit's
    # Chroma scheduler_config is the same)
    scheduler = FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True,
        base_shift=0.5, max_shift=1.15, base_image_seq_len=256, max_image_seq_len=4096,
    )
    pipe = ChromaPipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                          transformer=transformer)
    out_dir = Path(out_dir)
    pipe.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


# The learning check's settings (bench/learns.py; bench/learns_settings.py gathers every family's): the tiny model's
# width (model.arch) and the run that memorises one image, each choice's measured reason beside it.
# tiny_flux's run (the same blocks): 8 heads (128 wide), rank 16, 300 steps at lr 1e-3 reach ratio 0.056 for the
# diffusers and the kohya (merged as ComfyUI) file, 264 s on 2 shared cores; a misnamed block (0.323) and a halved
# scale (0.320) stay above the 0.2 bound (bench.learns --only tiny_chroma, 2026-11-29).
LEARNS = {"tiny_chroma": {"arch": {"num_attention_heads": 8}, "rank": 16, "steps": 300, "lr": 1e-3}}
