"""The pure core of loraflow: plain functions, no Prefect (flows/ wraps them in tasks and a flow).

The top level is the DAG: one module per node (validate, cache_latents, cache_text, train, sample, publish)
and its glue (config: the Hydra schema; items: per-item status and background writes; report: what changed;
runtime: device and library versions in keys; lazy: heavy libraries imported on first use). Everything else
lives in a sub-package by concern, each saying what it may import (checked by tests/test_imports.py):

- store/     content-addressed entries, keys and their bookkeeping; imports nothing else of the project
- data/      what goes in: images, captions, datasets, prompts, caption augmentation
- models/    one adapter per family, the tiny builders, LoRA on the text encoders
- training/  the train node's parts: set-up, keys, checkpoints, processes, memory, export
"""
