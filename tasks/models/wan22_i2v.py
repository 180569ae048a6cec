"""Wan 2.2 I2V-A14B: Wan 2.2's two experts (model.expert: high, low or both; tasks/models/wan22.py) on 36 input
channels, conditioned as Wan 2.1 I2V without the CLIP image states (tasks/models/wan_i2v.py)."""
from __future__ import annotations

from tasks.models.bases.adapter import KohyaLayout
from tasks.models.bases.real_size import RealSize
from tasks.models.wan import KOHYA_RULES
from tasks.models.wan22 import Wan22Adapter
from tasks.models.wan_i2v import FirstFrameConcat


class Wan22I2VAdapter(FirstFrameConcat, Wan22Adapter):
    """Wan 2.2 I2V-A14B: the two experts of Wan 2.2 (model.expert), 36 input channels, no image encoder."""
    family = "wan22_i2v"
    kohya = KohyaLayout("networks.lora_wan", "wan2.2_i2v", rules=KOHYA_RULES, lycoris_names="comfyui")

    # -- full size (bench.memory: tasks/models/bases/real_size.py) --------------------------------
    # convert_wan_to_diffusers.py "Wan2.2-I2V-14B-720p" (each expert): 36 input channels, no image states; one expert
    # (model.expert=high|low; the two have the same shapes) or both (the `_both` card rows: both experts resident)
    real_sizes = tuple(RealSize(name, "WanTransformer3DModel", {"in_channels": 36}, size=(832, 480), frames=frames,
                                vae=("AutoencoderKLWan", {}), text=(("text_encoder", "umt5_xxl"),), denoisers=("transformer", "transformer_2"),
                                rows=rows, cards=(1, 2)) for name, frames, rows in (
        ("wan22_i2v_a14b", 81, ("nf4+ckpt", "nf4+ckpt+offload+swap11")), ("wan22_i2v_a14b_33f", 33, ())))
