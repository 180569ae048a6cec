"""Reading a base model's weights: stream_load.py (the denoiser read tensor by tensor and stored as
model.quantize says: docs/loading.md), fp8_single_file.py (an fp8 transformer file kept in its own dtypes)."""
