"""Sampling during training: the prompts file is re-read at every sample point; editing it while
training runs never crashes the run (sd-scripts: `'NoneType' object has no attribute 'to'`)."""
from __future__ import annotations

from pathlib import Path

import pytest

from tasks.training import checkpoint_samples


@pytest.fixture
def after_sample_point():
    hooks = checkpoint_samples.AFTER_SAMPLE_POINT
    yield hooks
    hooks.clear()


def test_prompts_file_edited_while_training(workspace, after_sample_point):
    original = workspace.prompts.read_text()

    def edit_after_first(step, entries):
        if step == 4:
            workspace.prompts.write_text(original + "a purple star on a grey background\n"
                                         "broken line --w notanumber\n")

    after_sample_point.append(edit_after_first)
    r = workspace.run("sample.every_n_steps=4")  # 12 steps: sample points 4, 8, 12
    assert r["nodes"]["train"]["status"] == "ran"
    shots = r["artifacts"]["checkpoint_samples"]
    assert sorted(shots, key=int) == ["4", "8", "12"]
    assert len(shots["4"]) == 3 and len(shots["8"]) == 4 and len(shots["12"]) == 4
    assert any("purple_star" in Path(p).name for p in shots["8"])
    assert all(Path(p).is_file() and Path(p).parent.name.startswith("step_") for ps in shots.values() for p in ps)
    bad_line = len(original.splitlines()) + 2
    assert any(f":{bad_line}:" in w and "notanumber" in w for w in r["warnings"]), r["warnings"]  # named

    # The new prompt was encoded at the sample point and stored: the next run's cache_text reuses it.
    again = workspace.run("sample.every_n_steps=4")
    assert again["nodes"]["cache_text"]["computed"] == 0 and again["nodes"]["train"]["status"] == "cached"
    assert again["nodes"]["sample"]["computed"] == 1  # the final render of the new prompt


def test_a_missing_prompts_file_mid_training_is_a_warning(workspace, after_sample_point):
    after_sample_point.append(lambda step, entries: workspace.prompts.unlink(missing_ok=True))
    r = workspace.run("sample.every_n_steps=4", "train.seed=3")
    # Training finished; the final samples come from the prompts validate read before training.
    assert r["nodes"]["train"]["status"] == "ran" and len(r["artifacts"]["samples"]) == 3
    assert [len(v) for _, v in sorted(r["artifacts"]["checkpoint_samples"].items(), key=lambda kv: int(kv[0]))] == [3, 0, 0]
    assert sum("sampling failed" in w and "does not exist" in w for w in r["warnings"]) == 2


def test_sampling_does_not_change_training(workspace):
    plain = workspace.run("train.seed=5")
    sampled = workspace.run("train.seed=5", "sample.every_n_steps=6")
    assert sampled["nodes"]["train"]["status"] == "ran"
    assert sampled["loss"] == plain["loss"]
    assert Path(sampled["artifacts"]["lora"]).read_bytes() == Path(plain["artifacts"]["lora"]).read_bytes()


def test_samples_are_published_as_they_are_rendered(workspace, after_sample_point):
    """While training goes on (at the sample point, before the next step): the images are in
    <run dir>/samples/step_<k>/, in TensorBoard as images, and a Prefect artifact of the flow run."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir = workspace.root / f"run{workspace.runs + 1}"
    seen = {}

    def look(step, entries):
        folder = run_dir / "samples" / f"step_{step}"
        seen[step] = {"files": sorted(p.name for p in folder.glob("*.png")), "report": (run_dir / "report.json").exists()}
        folders = {f.parent for f in (run_dir / "tensorboard").rglob("events.out.tfevents.*")}
        events = EventAccumulator(str(min(folders)), size_guidance={"images": 0})  # accelerate's run folder
        events.Reload()
        seen[step]["tensorboard"] = sorted({(t, e.step) for t in events.Tags()["images"] for e in events.Images(t)})
        with get_client(sync_client=True) as client:
            arts = client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["loraflow-training-samples"])))
        seen[step]["artifacts"] = [a.description for a in arts]

    after_sample_point.append(look)
    r = workspace.run("sample.every_n_steps=4")  # 12 steps: sample points 4, 8, 12
    assert sorted(seen) == [4, 8, 12]
    for step, s in seen.items():
        assert len(s["files"]) == 3 and not s["report"], s  # rendered, training not finished
        assert {(f"samples/{Path(f).stem}", step) for f in s["files"]} <= set(s["tensorboard"]), s
        assert f"samples at step {step}, {run_dir / 'samples' / f'step_{step}'}" in s["artifacts"], s
    # the report lists the same files
    assert sorted(Path(p).name for p in r["artifacts"]["checkpoint_samples"]["8"]) == seen[8]["files"]
