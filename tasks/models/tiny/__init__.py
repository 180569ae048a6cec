"""Tiny, deterministic pipelines of every family, built offline from the real diffusers/transformers classes (a
few hundred kB each; no download): one module per family or per shared base class, their conventions and shared
parts in common.py. `model=tiny_<family>` builds one into the store (tasks/models/__init__.py: FAMILIES)."""
