"""LoRA file tools, the `loraflow-lora` command (cli.py; docs/lora-files.md): resize, merge, convert and extract
LoRAs in the two layouts loraflow exports (kohya and diffusers/PEFT), and merge them into a base model's denoiser.

formats.py reads and writes both layouts into one in-memory form, names.py maps module names between them (with
tasks/training/export.py's own mapping), ops.py does the maths, models.py reads base models and writes merged
ones (ldm.py: SD1.5/SDXL's original key layout). Pure core: may import tasks.training (export), tasks.models
(the families' diffusers classes) and tasks.store; no Prefect, no Hydra of its own."""
