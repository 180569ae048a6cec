"""LoRA beyond the denoiser's plain Linear LoRA: lycoris.py (LoHa / LoKr through peft, and the LyCORIS file),
text_encoder_lora.py (train.text_encoder_lr: a LoRA on the text encoders)."""
