"""Wan 2.2 TI2V-5B trained image-to-video, as diffusers' WanImageToVideoPipeline samples it with expand_timesteps
(pipelines/wan/pipeline_wan_i2v.py: `first_frame_mask` in prepare_latents and the denoising loop): the first latent
frame of the noisy input is the clean latent of the given image (encoded alone), its tokens get timestep 0, and the
pipeline throws its prediction away, so the loss is on the frames after it. The model is the Wan 2.2 VAE's (48
channels, /16 in space). The condition is cached per clip like Wan 2.1's (tasks/models/wan_i2v.py)."""
from __future__ import annotations

from tasks.lazy import LazyClass, lazy, no_grad
from tasks.models.bases.adapter import Controls, KohyaLayout
from tasks.models.bases.flow_matching import weighted_loss
from tasks.models.bases.real_size import RealSize
from tasks.models.wan import KOHYA_RULES, WanAdapter

torch = lazy("torch")


# convert_wan_to_diffusers.py "Wan2.2-TI2V-5B": 24 heads x 128 = 3072 wide, ffn 14336, 30 blocks, 48 channels in and
# out (the Wan 2.2 VAE's z_dim); its VAE (vae22_diffusers_config: base_dim 160, decoder_base_dim 256, is_residual,
# patch_size 2, scale_factor_spatial 16)
TI2V_5B = {"num_attention_heads": 24, "attention_head_dim": 128, "ffn_dim": 14336, "num_layers": 30, "in_channels": 48,
           "out_channels": 48, "text_dim": 4096, "freq_dim": 256, "patch_size": (1, 2, 2)}
WAN22_VAE = dict(base_dim=160, decoder_base_dim=256, z_dim=48, is_residual=True, in_channels=12, out_channels=12,
                 patch_size=2, scale_factor_spatial=16, latents_mean=[0.0] * 48, latents_std=[1.0] * 48)

class Wan22TI2VAdapter(WanAdapter):
    """Wan 2.2 TI2V-5B: the first latent frame replaced by the clean condition, its tokens at timestep 0."""
    family = "wan22_ti2v"
    infer_factors = (37.4, 13.4)  # the sample node's forward: its AdaLN tensors are per token (bench.memory --nodes)
    kohya = KohyaLayout("networks.lora_wan", "wan2.2_ti2v", rules=KOHYA_RULES, lycoris_names="comfyui")
    controls = Controls(most=1, required=True, first_frame=True)
    pipeline_cls = LazyClass("diffusers", "WanImageToVideoPipeline")  # loads the repository's WanPipeline folder
    size_multiple = 32  # the Wan 2.2 VAE's /16, then 2x2 patches
    # a timestep per token, so each block's AdaLN shift/scale is a per-token tensor (6 values a token, offloaded
    # with the block's hidden states: 7), and an FFN 4.7x its width (bench.memory: per block 50.5 / 50.7 at 704x1280,
    # 121 / 49 frames; checkpointed 1.305; recompute 50.7 / 50.9; in flight 19.0, 13 elsewhere)
    activation_factors = (50.6, 1.31, 50.8)
    activation_extras = {"in_flight": 19.0, "offloaded": 7.0, "text_offloaded": 1.0}

    @staticmethod
    def activation_geometry(config: dict, size: tuple[int, int], text_tokens: int, frames: int = 1) -> tuple[int, int, int]:
        w, h = size
        pt, ph, pw = config["patch_size"]
        tokens = ((1 + (frames - 1) // 4) // pt) * (h // (16 * ph)) * (w // (16 * pw))
        return tokens, config["num_attention_heads"] * config["attention_head_dim"], config["num_layers"]

    def load_condition_encoder(self):
        return None

    @no_grad
    def encode_condition(self, vae, encoder, pixels, images, frames: int) -> list[dict]:
        """The first frame encoded alone (the pipeline's `video_condition = image`): [C, 1, h, w] per clip."""
        return [{"latents": z} for z in self.encode_latents(vae, pixels[:, :, None])]

    def training_loss(self, transformer, latents, text, train_cfg, scheduler, generators):
        noisy, noise, timesteps, sigmas = self.draw(latents, train_cfg, scheduler, generators)
        cond = text["control_latents"][:, 0].to(latents.dtype)
        noisy = torch.cat([cond, noisy[:, :, 1:]], dim=2)  # (1 - mask) * condition + mask * latents
        pt, ph, pw = transformer.config.patch_size
        f, h, w = latents.shape[2:]
        per_frame = (h // ph) * (w // pw)
        t = timesteps.to(latents.dtype)[:, None].repeat(1, (f // pt) * per_frame)
        t[:, :per_frame] = 0  # the pipeline's first_frame_mask[:, ::2, ::2] * t: the given frame is clean
        pred = transformer(hidden_states=noisy, timestep=t, encoder_hidden_states=text["prompt_embeds"].to(latents.dtype),
                           return_dict=False)[0]
        target = noise - latents
        return weighted_loss(pred[:, :, 1:], target[:, :, 1:], sigmas, train_cfg)  # the frames it predicts

    # -- full size (bench.memory: tasks/models/bases/real_size.py) --------------------------------
    # at its model card's 704x1280, 121 frames (31 x 22 x 40 = 27,280 tokens), and 49 for the smaller cards
    real_sizes = tuple(RealSize(name, "WanTransformer3DModel", TI2V_5B, size=(1280, 704), frames=frames,
                                vae=("AutoencoderKLWan", WAN22_VAE), text=(("text_encoder", "umt5_xxl"),), rows=rows,
                                cards=(1,)) for name, frames, rows in (
        ("wan22_ti2v_5b", 121, ("bf16+ckpt", "nf4+ckpt", "nf4+ckpt+offload+swap24")),
        ("wan22_ti2v_5b_49f", 49, ("bf16+ckpt", "fp8+ckpt", "nf4+ckpt", "nf4+ckpt+offload"))))

    @staticmethod
    def bench_batch(config, size, frames, text_len):
        # 48-channel latents of the Wan 2.2 VAE (/16); the condition: the first frame's latent
        (w, h), z = size, lambda *s: torch.zeros(*s, dtype=torch.bfloat16)  # noqa: E731
        c, f = config["in_channels"], 1 + (frames - 1) // 4
        return z(1, c, f, h // 16, w // 16), {"prompt_embeds": z(1, text_len, config["text_dim"]),
                                              "control_latents": z(1, 1, c, 1, h // 16, w // 16)}
