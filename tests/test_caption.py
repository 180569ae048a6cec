"""The caption node (issue 65): images without a caption captioned by a vision-language model (the tiny Qwen2.5-VL,
`caption.model=tiny_vlm`, loaded as a real one is), cached per image by its bytes, the captioner, the prompt and
the generation settings; a hand-written caption always wins; the user's folder is never written unless asked;
an OpenAI-compatible server (uvicorn + FastAPI on 127.0.0.1) instead of a local model."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from PIL import Image, ImageOps

from tasks import caption, validate
from tasks.captioning import CaptionError
from tasks.captioning.files import MARKER
from tasks.config import compose, resolve_paths
from tasks.data.dataset import DatasetError
from tasks.store import Store

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "data" / "demo"
HAND = "a hand-written caption of the first image"
IMAGES = sorted(p.name for p in DEMO.glob("*.png"))  # 12


def _data(root: Path) -> Path:
    """The demo's images, one of them (img_00) with a hand-written caption, the rest without."""
    data = root / "data"
    data.mkdir(parents=True)
    for name in IMAGES:
        shutil.copyfile(DEMO / name, data / name)
    (data / "img_00.txt").write_text(HAND + "\n")
    return data


def _cfg(root: Path, data: Path, *extra: str):
    return resolve_paths(compose("train", [f"data.dir={data}", f"store.root={root / 'store'}", "data.resolution=32",
                                           "data.captions=auto", "caption.model=tiny_vlm", "caption.max_new_tokens=8",
                                           "train.max_steps=2", "train.log_with=none", "sample.steps=2", *extra])[0])


def _files(folder: Path) -> dict[str, bytes]:
    """Every file under `folder` (hidden ones too) with its bytes."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture
def ws(tmp_path):
    data = _data(tmp_path)
    return tmp_path, data, Store(tmp_path / "store")


def test_tiny_vlm_is_the_same_bytes_on_every_build(tmp_path):
    from tasks.models.tiny.tiny_vlm import build_tiny_vlm

    assert _files(build_tiny_vlm(tmp_path / "a")) == _files(build_tiny_vlm(tmp_path / "b"))


def test_auto_captions_the_images_without_one_and_leaves_the_folder_alone(ws):
    root, data, store = ws
    before = _files(data)
    cfg = _cfg(root, data)
    result = caption.run(cfg, store, root / "run")
    assert (result["computed"], result["reused"]) == (11, 0)
    summary = dict(result["summary"])
    assert summary.pop("memory_estimate")["device_gb"] > 0  # the preflight (test_the_captioner_has_a_preflight...)
    assert summary == {"mode": "auto", "captioner": "tiny_vlm", "captioned": 11, "hand_written": 1, "empty": []}
    assert _files(data) == before  # nothing written beside the images, no marker
    made = {Path(f).stem: t for f, t in result["captions"].items()}
    assert sorted(made) == [Path(n).stem for n in IMAGES[1:]] and all(made.values())
    assert len(set(made.values())) > 5  # the image decides the caption (10 distinct of 11 for the tiny model)
    written = {p.stem: p.read_text() for p in (root / "run" / "captions").glob("*.txt")}
    assert written == {s: t + "\n" for s, t in made.items()}
    plan = validate.run(cfg, store, result["captions"])
    captions = {it["name"]: it["caption"] for it in plan.items}
    assert captions["img_00.png"] == HAND  # the hand-written one wins
    assert all(captions[f"{s}.png"] == t for s, t in made.items())


def test_cached_per_image_one_new_image_captions_one_a_new_prompt_all(ws):
    root, data, store = ws
    first = caption.run(_cfg(root, data), store)
    again = caption.run(_cfg(root, data), store)
    assert (again["computed"], again["reused"], again["key"]) == (0, 11, first["key"])
    ImageOps.mirror(Image.open(data / "img_03.png")).save(data / "img_99.png")
    grown = caption.run(_cfg(root, data), store)
    assert (grown["computed"], grown["reused"]) == (1, 11)
    assert {k: v for k, v in grown["captions"].items() if "img_99" not in k} == first["captions"]
    reworded = caption.run(_cfg(root, data, "caption.prompt=Name the shapes and colours."), store)
    assert (reworded["computed"], reworded["reused"]) == (12, 0)
    longer = caption.run(_cfg(root, data, "caption.max_new_tokens=9"), store)  # a generation setting: in the key
    assert longer["computed"] == 12
    assert caption.run(_cfg(root, data, "caption.dtype=bfloat16"), store)["computed"] == 12  # the dtype too
    os.remove(data / "img_99.png")
    removed = caption.run(_cfg(root, data), store)
    assert (removed["computed"], removed["reused"]) == (0, 11)


def test_a_hand_written_caption_added_takes_the_model_captions_place(ws):
    root, data, store = ws
    cfg = _cfg(root, data)
    caption.run(cfg, store)
    (data / "img_03.txt").write_text("written by hand later\n")
    result = caption.run(cfg, store)
    assert (result["computed"], result["reused"], result["summary"]["hand_written"]) == (0, 10, 2)
    plan = validate.run(cfg, store, result["captions"])
    assert {it["name"]: it["caption"] for it in plan.items}["img_03.png"] == "written by hand later"


def test_regenerate_makes_every_model_caption_anew_and_keeps_the_hand_written(ws):
    root, data, store = ws
    caption.run(_cfg(root, data), store)
    before = _files(data)
    result = caption.run(_cfg(root, data, "data.captions=regenerate"), store)
    assert (result["computed"], result["reused"]) == (11, 0)
    assert result["summary"]["hand_written"] == 1 and _files(data) == before


def test_file_mode_loads_no_captioner(ws):
    root, data, store = ws
    os.remove(data / "img_00.txt")
    result = caption.run(_cfg(root, data, "data.captions=file"), store)
    assert (result["computed"], result["reused"], result["captions"]) == (0, 0, {})
    assert not (root / "store" / "models").exists()  # tiny_vlm was never built
    with pytest.raises(DatasetError, match="data.captions=auto"):  # the missing captions' hint names the node
        validate.run(_cfg(root, data, "data.captions=file"), store)


def test_beside_images_writes_only_when_asked_and_never_over_a_hand_written_caption(ws):
    root, data, store = ws
    first = caption.run(_cfg(root, data, "caption.beside_images=true"), store)
    record = json.loads((data / MARKER).read_text())
    assert sorted(record) == [f"{Path(n).stem}.txt" for n in IMAGES[1:]]
    assert (data / "img_00.txt").read_text() == HAND + "\n"
    for image, text in first["captions"].items():
        assert Path(image).with_suffix(".txt").read_text() == text + "\n"
    # The next run reads its own files as its own (the store answers), not as hand-written
    again = caption.run(_cfg(root, data, "caption.beside_images=true"), store)
    assert (again["computed"], again["reused"], again["summary"]["hand_written"]) == (0, 11, 1)
    # A person edits one of them: from then on it is theirs; a new prompt rewrites only loraflow's own
    (data / "img_05.txt").write_text("edited by hand\n")
    reworded = caption.run(_cfg(root, data, "caption.beside_images=true", "caption.prompt=Name the shapes."), store)
    assert (reworded["computed"], reworded["summary"]["hand_written"]) == (10, 2)
    assert (data / "img_05.txt").read_text() == "edited by hand\n"
    assert (data / "img_00.txt").read_text() == HAND + "\n"
    for image, text in reworded["captions"].items():
        assert Path(image).with_suffix(".txt").read_text() == text + "\n"
    assert {Path(i).name for i in reworded["captions"]}.isdisjoint({"img_00.png", "img_05.png"})


def _silent_model(folder: Path) -> Path:
    """The tiny captioner made to answer nothing, whatever the image: the final norm keeps one feature (its
    sign is the hidden state's), the output rows are zero but for the two end tokens of generation_config.json
    (<|im_end|>, <|endoftext|>), +1 and -1 on that feature: one of them is the best next token (0 elsewhere)."""
    from safetensors.torch import load_file, save_file

    from tasks.models.tiny.tiny_vlm import build_tiny_vlm

    build_tiny_vlm(folder)
    weights = load_file(folder / "model.safetensors")
    im_end, endoftext = json.loads((folder / "generation_config.json").read_text())["eos_token_id"]
    norm = next(k for k in weights if k.endswith("norm.weight") and "layers" not in k and "visual" not in k)
    weights[norm] = weights[norm] * 0
    weights[norm][0] = 1.0
    head = weights["lm_head.weight"] * 0
    head[im_end, 0], head[endoftext, 0] = 1.0, -1.0
    weights["lm_head.weight"] = head
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def test_a_captioner_that_answers_nothing_is_a_missing_caption(ws):
    root, data, store = ws
    silent = _silent_model(root / "silent")
    cfg = _cfg(root, data, f"caption.model={silent}")
    result = caption.run(cfg, store)
    assert result["summary"]["empty"] == sorted(IMAGES[1:]) and result["summary"]["captioned"] == 11
    with pytest.raises(DatasetError) as e:
        validate.run(cfg, store, result["captions"])
    assert "img_01.png: the caption model returned an empty caption" in str(e.value)
    plan = validate.run(_cfg(root, data, f"caption.model={silent}", "data.missing_caption=empty"), store,
                        result["captions"])
    assert {it["caption"] for it in plan.items} == {HAND, ""}


def test_a_caption_over_the_text_window_is_reported(ws):
    root, data, store = ws
    cfg = _cfg(root, data, "caption.max_new_tokens=40", "model.max_sequence_length=8")
    plan = validate.run(cfg, store, caption.run(cfg, store)["captions"])
    over = [w for w in plan.warnings if "over the text window of 8" in w]
    assert len(over) == 11 and "caption of img_01.png" in " ".join(over)


def test_a_missing_captioner_is_refused_in_one_line(ws):
    root, data, store = ws
    with pytest.raises(CaptionError, match=r"caption.model=.*nope: no such folder"):
        caption.run(_cfg(root, data, f"caption.model={root / 'nope'}"), store)
    with pytest.raises(CaptionError, match="no config.json"):
        (root / "empty").mkdir()
        caption.run(_cfg(root, data, f"caption.model={root / 'empty'}"), store)


def test_a_quantized_captioner_captions(ws):
    root, data, store = ws
    result = caption.run(_cfg(root, data, "caption.quantize=int8"), store)
    assert result["computed"] == 11 and all(result["captions"].values())
    plain = caption.run(_cfg(root, data), store)
    assert plain["computed"] == 11  # a quantized captioner's captions never stand in for the unquantized one's


# --- an OpenAI-compatible server (tests/caption_server.py: uvicorn + FastAPI, the tiny captioner behind it) ---
@pytest.fixture(scope="module")
def server(tmp_path_factory):
    import socket
    import urllib.request

    from tasks.models.tiny.tiny_vlm import build_tiny_vlm

    model = build_tiny_vlm(tmp_path_factory.mktemp("served") / "tiny_vlm")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, str(REPO / "tests" / "caption_server.py"), "--port", str(port),
                             "--model", str(model), "--slow", "5"], env={**os.environ, "HF_HUB_OFFLINE": "1"})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        try:
            urllib.request.urlopen(url + "/health", timeout=2)
            break
        except OSError:
            assert proc.poll() is None and time.monotonic() < deadline, "the caption server did not start"
            time.sleep(0.3)
    yield url, model
    proc.terminate()
    proc.wait(timeout=30)


def test_an_endpoint_captions_as_the_local_model_behind_it_does(ws, server):
    root, data, store = ws
    url, model = server
    served = caption.run(_cfg(root, data, f"caption.endpoint={url}/v1", "caption.model=tiny-vlm"), store)
    local = caption.run(_cfg(root, data, f"caption.model={model}"), store)
    assert served["computed"] == local["computed"] == 11  # another captioner: its own keys
    assert served["captions"] == local["captions"]  # the PNG sent is the pixels the local model sees
    assert served["inputs"]["captioner"] == {"endpoint": f"{url}/v1", "model": "tiny-vlm"}
    again = caption.run(_cfg(root, data, f"caption.endpoint={url}/v1", "caption.model=tiny-vlm"), store)
    assert (again["computed"], again["reused"]) == (0, 11)


@pytest.mark.parametrize("path, message", [
    ("slow", "no answer within caption.timeout=1 s for img_01.png"),
    ("broken", "the server answered HTTP 500 for img_01.png"),
    ("nowhere", "the server answered HTTP 404 for img_01.png")])
def test_an_endpoint_that_fails_is_one_line_and_leaves_nothing_half_written(ws, server, path, message):
    root, data, store = ws
    url, _ = server
    before = _files(data)
    with pytest.raises(CaptionError) as e:
        caption.run(_cfg(root, data, f"caption.endpoint={url}/{path}/v1", "caption.timeout=1"), store, root / "run")
    assert message in str(e.value) and "\n" not in str(e.value)
    assert not (root / "store" / caption.KIND).exists() or not any((root / "store" / caption.KIND).rglob("*.json"))
    assert not any((root / "store" / "tmp").glob("*")) if (root / "store" / "tmp").exists() else True
    assert not (root / "run" / "captions").exists() and _files(data) == before


def test_an_endpoint_that_answers_nothing_gives_empty_captions(ws, server):
    root, data, store = ws
    url, _ = server
    result = caption.run(_cfg(root, data, f"caption.endpoint={url}/empty/v1"), store)
    assert result["summary"]["empty"] == sorted(IMAGES[1:])


def test_the_cli_refuses_a_failing_captioner_in_one_line_with_exit_code_2(ws, server, tmp_path):
    root, data, _ = ws
    url, _ = server
    sys.path.insert(0, str(Path(__file__).parent))
    from support import run_cli

    proc = run_cli([f"data.dir={data}", f"store.root={root / 'store'}", "data.captions=auto",
                    f"caption.endpoint={url}/broken/v1", "caption.model=tiny-vlm", f"hydra.run.dir={root / 'run'}"],
                   REPO, tmp_path)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stdout + proc.stderr
    assert "the server answered HTTP 500 for img_01.png" in proc.stderr


# --- the whole flow: caption first, then the nodes as ever ---------------------------------------------------
def test_the_flow_captions_first_and_a_new_image_captions_only_itself(prefect_api, tmp_path):
    from flows.explain import explain
    from flows.train import train_flow

    data = _data(tmp_path)
    base = [f"data.dir={data}", f"store.root={tmp_path / 'store'}", "data.captions=auto", "caption.model=tiny_vlm",
            "caption.max_new_tokens=8", "train.max_steps=2", "sample.steps=2", "train.log_with=none"]

    def run(n: int, *extra: str) -> dict:
        out = train_flow(config_name="train", overrides=[*base, f"hydra.run.dir={tmp_path / f'run{n}'}", *extra])
        return json.loads(Path(out["report"]).read_text())

    first = run(1)
    nodes = first["nodes"]
    assert list(nodes)[:2] == ["caption", "validate"]
    assert (nodes["caption"]["computed"], nodes["caption"]["captions"]["hand_written"]) == (11, 1)
    captions = {p.stem: p.read_text().strip() for p in Path(first["artifacts"]["captions"]).glob("*.txt")}
    assert len(captions) == 11 and nodes["cache_latents"]["computed"] == 12
    ImageOps.mirror(Image.open(data / "img_03.png")).save(data / "img_99.png")
    second = run(2)
    n = {k: (e["computed"], e["reused"]) for k, e in second["nodes"].items() if k != "validate"}
    new_caption = (tmp_path / "run2" / "captions" / "img_99.txt").read_text().strip()
    assert n["caption"] == (1, 11) and n["cache_latents"] == (1, 12)
    assert n["cache_text"][0] == (0 if new_caption in captions.values() else 1)  # a new text only if it is one
    assert second["nodes"]["train"]["status"] == "ran" and second["nodes"]["sample"]["computed"] == 3
    assert _files(data).keys() == {*(IMAGES), "img_00.txt", "img_99.png"}  # the folder: as the user left it
    would = explain("train", [*base, "caption.prompt=Name the shapes."])["nodes"]
    assert (would["caption"]["would"], would["caption"]["compute"]) == ("run", 12)
    assert would["cache_text"]["compute"] >= 1 and would["train"]["would"] == "run"


def _tiny_qwen3vl(folder: Path) -> Path:
    """A Qwen3-VL instruct folder at a tiny width (its 16 px patches, interleaved mRoPE, deepstack), laid out as
    the tiny Qwen2.5-VL's: the second class caption.model loads."""
    import torch
    from transformers import GenerationConfig, Qwen2VLImageProcessorPil, Qwen3VLConfig, Qwen3VLForConditionalGeneration

    from tasks.models.tiny.tiny_qwenimage import QWEN25VL_SPECIALS, qwen25vl_tokenizer
    from tasks.models.tiny.tiny_vlm import QWEN25VL_INSTRUCT_TEMPLATE

    tok = qwen25vl_tokenizer(400, system="You are a helpful assistant.")
    tok.chat_template = QWEN25VL_INSTRUCT_TEMPLATE  # Qwen3-VL's renders an image part the same way
    ids = {t: tok.convert_tokens_to_ids(t) for t in QWEN25VL_SPECIALS}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = Qwen3VLForConditionalGeneration(Qwen3VLConfig(
            text_config=dict(vocab_size=len(tok), hidden_size=32, intermediate_size=37, num_hidden_layers=2,
                             num_attention_heads=2, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
                             rope_parameters={"rope_type": "default", "rope_theta": 5000000.0,
                                              "mrope_section": [2, 3, 3], "mrope_interleaved": True},
                             bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"],
                             pad_token_id=ids["<|endoftext|>"]),
            vision_config=dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=32,
                               patch_size=16, num_position_embeddings=64, deepstack_visual_indexes=[0]),
            image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
            vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
            tie_word_embeddings=False))
    model.save_pretrained(folder, safe_serialization=True)
    tok.save_pretrained(folder)
    GenerationConfig(eos_token_id=[ids["<|im_end|>"], ids["<|endoftext|>"]],
                     pad_token_id=ids["<|endoftext|>"]).save_pretrained(folder)
    Qwen2VLImageProcessorPil(patch_size=16, temporal_patch_size=2, merge_size=2, min_pixels=4096, max_pixels=128 * 128,
                             image_mean=[0.5] * 3, image_std=[0.5] * 3).save_pretrained(folder)
    return folder


def test_a_qwen3_vl_folder_captions_too(ws):
    root, data, store = ws
    result = caption.run(_cfg(root, data, f"caption.model={_tiny_qwen3vl(root / 'qwen3vl')}"), store)
    assert result["computed"] == 11
    assert sum(bool(t) for t in result["captions"].values()) >= 1  # random weights: words, or an early end


def test_the_captioner_has_a_preflight_and_is_refused_before_loading_when_it_cannot_fit(ws):
    import torch

    from tasks.captioning import memory
    from tasks.models.tiny.tiny_vlm import build_tiny_vlm

    root, data, store = ws
    folder = build_tiny_vlm(root / "vlm")
    plain = memory.estimate(folder, "float32", "none", False, 8, None)
    from safetensors.torch import load_file

    stored = sum(t.numel() * t.element_size() for t in load_file(folder / "model.safetensors").values())
    assert plain["weights_gb"] * 2**30 == stored  # every weight as loaded in float32: exact
    nf4 = memory.estimate(folder, "float32", "nf4", False, 8, None)
    assert nf4["weights_gb"] < plain["weights_gb"] and plain["activations_gb"] > 0
    result = caption.run(_cfg(root, data), store)
    assert result["summary"]["memory_estimate"]["setting"] == "caption.quantize=none caption.max_pixels=1048576"
    with pytest.raises(CaptionError, match=r"caption.model=tiny_vlm: the captioner needs about .* GiB "
                                           r"\(caption.quantize=none caption.max_pixels=1048576\) > 0.00 GiB \(train.memory_limit_gb\); nothing"):
        caption.run(_cfg(root, data, "caption.prompt=other", "train.memory_limit_gb=0.000001"), store)
    assert torch.is_grad_enabled()  # nothing left switched off by a refusal


def test_batches_as_the_card_allows(ws):
    root, data, store = ws
    full = caption.run(_cfg(root, data, "caption.batch_size=0"), store)
    assert full["summary"]["memory_estimate"]["batch"] == 16 and full["computed"] == 11  # a tiny model: the cap
    from tasks.captioning import memory
    from tasks.models.tiny.tiny_vlm import build_tiny_vlm

    folder = build_tiny_vlm(root / "vlm")
    sizes = [memory.estimate(folder, "float32", "none", False, 8, 1048576, b)["device_gb"] for b in (1, 2, 3)]
    budget = (sizes[1] + sizes[2]) / 2  # room for two images a batch, not three
    picked = caption.run(_cfg(root, data, "caption.batch_size=0", "caption.prompt=third",
                              f"train.memory_limit_gb={budget}"), store)
    assert picked["summary"]["memory_estimate"]["batch"] == 2 and picked["computed"] == 11
