"""Caption augmentation WITH the text cache (sd-scripts refuses the combination): every augmentation
trains from cached variants, the report counts them, and a second identical run encodes nothing."""
from __future__ import annotations

import pytest

N_ITEMS = 12


def _tag_captions(ws):
    """kohya-style tag captions: 'a red circle, a blue background, flat colors, toy'."""
    for txt in ws.data.glob("*.txt"):
        txt.write_text(txt.read_text().strip().replace(" on ", ", ") + ", flat colors, toy\n")


def _text(report):
    return report["nodes"]["cache_text"], report["text_augmentation"]


@pytest.mark.parametrize("overrides,per_caption", [
    (["data.caption_dropout_rate=0.5"], 1),                         # dropout: the cached empty prompt
    (["data.shuffle_caption=true", "text.variants=3"], 3),          # 3 cached shuffles per caption
    (["data.caption_tag_dropout_rate=0.3", "text.variants=2", "data.keep_tokens=1"], 2),
    (["data.token_warmup_step=8", "data.token_warmup_min=1"], None),  # one text per reachable length
])
def test_augmentation_with_the_text_cache(workspace, overrides, per_caption):
    _tag_captions(workspace)
    workspace.run()  # the plain tag captions cached
    first = workspace.run(*overrides)
    node, aug = _text(first)
    assert aug["active"] and aug["mode"] == "cached" and aug["description"].startswith("caption augmentation:")
    assert first["nodes"]["train"]["status"] == "ran"
    if per_caption is not None:
        assert aug["cached_caption_texts"] == per_caption * N_ITEMS
    else:  # the demo captions have one to a few comma-separated tags: at least one text each
        assert aug["cached_caption_texts"] > N_ITEMS
    # The plain captions and the empty prompt are cached: dropout needs nothing new.
    assert (node["computed"] == 0) == (overrides == ["data.caption_dropout_rate=0.5"])
    again = workspace.run(*overrides)
    assert again["nodes"]["cache_text"]["computed"] == 0 and again["nodes"]["train"]["status"] == "cached"
    assert again["text_augmentation"]["cached_caption_texts"] == aug["cached_caption_texts"]


def test_fresh_draws_encode_on_demand(workspace):
    _tag_captions(workspace)
    r = workspace.run("data.shuffle_caption=true", "text.fresh_draws=true")
    assert r["text_augmentation"]["mode"] == "fresh" and r["text_augmentation"]["cached_caption_texts"] == 0
    assert "fresh draw every step" in r["text_augmentation"]["description"]
    assert r["nodes"]["train"]["status"] == "ran"


def test_impossible_combination_names_both_settings(workspace):
    from tasks.config import ConfigError

    with pytest.raises(ConfigError) as e:
        workspace.run("data.shuffle_caption=true", "text.fresh_draws=true", "text.offload_encoders=true")
    assert "text.offload_encoders=true" in str(e.value) and "text.fresh_draws" in str(e.value)


def test_bad_augmentation_values_name_their_keys(workspace):
    from tasks.config import ConfigError

    with pytest.raises(ConfigError) as e:
        workspace.run("data.caption_dropout_rate=1.5", "text.variants=0")
    assert "data.caption_dropout_rate=1.5" in str(e.value) and "text.variants=0" in str(e.value)
