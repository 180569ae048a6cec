"""What the family adapters share, by what it does: adapter.py (the interface every family provides, and the
declarations it makes: KohyaLayout), unet.py (the SD1.x/SDXL UNet families), flow_matching.py (the transformer
families trained by flow matching), flux2.py (FLUX.2 [klein] and [dev]), losses.py (the loss options)."""
