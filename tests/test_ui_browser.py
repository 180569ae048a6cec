"""What a user sees in Prefect's UI, in a real browser: a `prefect server start`, a tiny training and a 2-member
sweep through the CLI against it, then the flow run's and the sweep's artifacts opened in headless Chromium
(Debian's, driven by selenium through Debian's chromedriver): every picture loaded (natural width > 0, the
width of the file it shows) under the labels it should carry. Screenshots: LORAFLOW_UI_SCREENSHOTS=DIR."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

from prefect_server import free_port, prefect_server
from ui_browser import browser, missing, page_text, screenshot, wait_for_images, wait_for_text

REPO = Path(__file__).resolve().parents[1]
FAST = ["train.max_steps=4", "train.log_every=2", "sample.steps=2"]


def _cli(server, args: list[str]) -> None:
    proc = subprocess.run([sys.executable, "-m", "flows.train", *args], cwd=REPO, text=True, capture_output=True,
                          timeout=600, env={**server.env, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]


def _artifact_ids(server, flow_run_id: str) -> dict[str, str]:
    import httpx

    r = httpx.post(f"{server.url}/artifacts/filter", json={"artifacts": {"flow_run_id": {"any_": [flow_run_id]}}},
                   timeout=30)
    r.raise_for_status()
    return {a["key"]: a["id"] for a in r.json()}


def _flow_runs(server, tag: str) -> list[dict]:
    import httpx

    r = httpx.post(f"{server.url}/flow_runs/filter", json={"flow_runs": {"tags": {"all_": [tag]}}}, timeout=30)
    r.raise_for_status()
    return r.json()


def test_pictures_load_in_a_real_browser(tmp_path):
    if problem := missing():
        pytest.fail(problem)
    data, prompts, store = tmp_path / "data", tmp_path / "prompts.txt", tmp_path / "store"
    shutil.copytree(REPO / "data" / "demo", data)
    shutil.copyfile(REPO / "data" / "demo_prompts.txt", prompts)
    common = [f"data.dir={data}", f"sample.prompts_file={prompts}", f"store.root={store}", *FAST]
    shots = os.environ.get("LORAFLOW_UI_SCREENSHOTS")
    port = free_port()
    # the UI asks the API at PREFECT_SERVER_API_PORT (docs/prefect.md): the same port as the server's
    with prefect_server(tmp_path / "prefect", port=port, server_settings={"PREFECT_SERVER_API_PORT": str(port), "PREFECT_SERVER_UI_ENABLED": "true"},
                        services={"scheduler": False}) as server:
        ui = server.url.removesuffix("/api")
        _cli(server, [*common, f"hydra.run.dir={tmp_path / 'run'}", "train.run_name=browser check"])
        _cli(server, ["-m", "train.lr=1e-3,2e-3", *common, f"hydra.sweep.dir={tmp_path / 'sweep'}"])

        run, = [r for r in _flow_runs(server, "family:flux") if r["name"] == "browser check"]
        run_artifacts = _artifact_ids(server, run["id"])
        from flows.run_names import sweep_id

        parent, = [r for r in _flow_runs(server, f"sweep:{sweep_id(tmp_path / 'sweep')}") if r["name"].startswith("sweep ")]
        sweep_artifacts = _artifact_ids(server, parent["id"])

        with browser() as driver:
            # the run's sample grid, on its artifact's page: loaded at the grid's own width, labelled with the prompts
            images = wait_for_images(driver, f"{ui}/v2/artifacts/artifact/{run_artifacts['loraflow-samples']}", 1, "sample grid")
            grid, = [i for i in images if i["alt"].startswith("sample grid")]
            assert grid["natural_width"] == Image.open(tmp_path / "run" / "samples" / "grid.png").width, images
            assert "a red circle on a blue background · seed 0" in grid["alt"]
            assert "a red circle on a blue background · seed 0" in page_text(driver)  # the list under the picture
            if shots:
                screenshot(driver, Path(shots) / "ui-samples.png")
            images = wait_for_images(driver, f"{ui}/v2/artifacts/artifact/{run_artifacts['loraflow-loss']}", 1, "training loss")
            chart, = [i for i in images if i["alt"].startswith("training loss")]
            assert chart["natural_width"] == Image.open(tmp_path / "run" / "loss.png").width, images
            assert "mean of steps 3-4" in page_text(driver)
            if shots:
                screenshot(driver, Path(shots) / "ui-loss.png")
            # the flow run's own page: its name, the Artifacts tab lists the run's artifacts
            shown = wait_for_text(driver, f"{ui}/v2/runs/flow-run/{run['id']}?tab=Artifacts", "loraflow-samples")
            assert "browser check" in shown and "loraflow-loss" in shown and "loraflow-report" in shown, shown[:3000]
            if shots:
                screenshot(driver, Path(shots) / "ui-flow-run.png")

            # the sweep's parent: the members side by side, the overlaid curves
            images = wait_for_images(driver, f"{ui}/v2/artifacts/artifact/{sweep_artifacts['loraflow-sweep-compare']}", 1,
                                     "members' samples")
            compare, = [i for i in images if i["alt"].startswith("members' samples")]
            assert compare["natural_width"] == Image.open(tmp_path / "sweep" / "compare.png").width, images
            assert "train.lr=0.001; train.lr=0.002" in compare["alt"]
            if shots:
                screenshot(driver, Path(shots) / "ui-sweep-compare.png")
            images = wait_for_images(driver, f"{ui}/v2/artifacts/artifact/{sweep_artifacts['loraflow-sweep-summary']}", 2, "members'")
            assert len([i for i in images if i["alt"].startswith("members'") and i["natural_width"] > 0]) == 2, images
            if shots:
                screenshot(driver, Path(shots) / "ui-sweep-summary.png")
