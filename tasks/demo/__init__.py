"""The demo world: coloured shapes on solid backgrounds (world.py), a scorer that checks an image shows
its caption (score.py), and the pretrained tiny Flux base that learned it (scripts/pretrain_demo_base.py)."""
