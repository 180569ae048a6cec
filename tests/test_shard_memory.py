"""train.shard=fsdp in the preflight (issue 63 items 4 and 5): the per-process estimate (tasks/training/shard_memory.py),
the shard count validate names when one card does not fit, and bench.memory's `<model>:<options>+fsdp<N>` rows.
Header-only FLUX.1-dev (its real config, no weights: tests/test_memory_estimate.py's fixture); no wall-clock figure."""
from __future__ import annotations

import json

import pytest

from tasks.config import ConfigError, updated
from tasks.models.flux import FluxAdapter
from tasks.training.memory import GB, estimate, header_shapes, preflight
from tests.test_bench_memory import MEASURED
from tests.test_memory_estimate import FLUX_DEV, TARGETS, _cfg, _headers
from tests.tolerance import PREFLIGHT_WITHIN

GIB = 1 << 30
LISTS = FluxAdapter.swap_blocks


@pytest.fixture(scope="module")
def flux_dev(tmp_path_factory):
    from diffusers import FluxTransformer2DModel

    return _headers(FluxTransformer2DModel, FLUX_DEV, tmp_path_factory.mktemp("flux-dev"))


def _est(folder, cfg, targets=TARGETS):
    from diffusers import FluxTransformer2DModel

    return estimate(cfg, folder, "transformer", targets, (1024, 1024), 512, FluxTransformer2DModel, LISTS,
                    geometry=FluxAdapter.activation_geometry)


def _sharded(n, **train):
    return _cfg(gradient_checkpointing=True, shard="fsdp", num_processes=n, batch_size=n, **train)


def _unit_bytes(folder, prefix):
    """A unit's bf16 bytes and its LoRA's parameters, summed here from the headers (not shard_memory's grouping)."""
    shapes = header_shapes(folder / "transformer")
    numel = {k: 1 for k in shapes}
    for k, s in shapes.items():
        for d in s:
            numel[k] *= d
    mine = [k for k in shapes if k.startswith(prefix)]
    lora = sum(16 * sum(shapes[k]) for k in mine if k.endswith(".weight") and len(shapes[k]) == 2
               and any(k[: -len(".weight")].endswith("." + t) for t in TARGETS))
    return sum(2 * numel[k] for k in mine), lora


def test_two_processes_hold_half_the_base_plus_the_gathered_units(flux_dev):
    one = _est(flux_dev, _cfg(gradient_checkpointing=True))
    two = _est(flux_dev, _sharded(2))
    # the largest unit: a double block (FLUX.1-dev's joint blocks are wider than its single ones), gathered with its
    # LoRA's fp32 weights and their gradients (8 bytes a parameter)
    block, lora = _unit_bytes(flux_dev, "transformer_blocks.0.")
    assert two["largest_unit_gb"] * GB == pytest.approx(block + 8 * lora, rel=1e-12)
    assert two["shard_gb"] == pytest.approx(one["weights_gb"] / 2, rel=1e-12)
    assert two["weights_gb"] == pytest.approx(one["weights_gb"] / 2 + 2 * two["largest_unit_gb"] + two["root_unit_gb"],
                                              rel=1e-12)
    # roughly halved: the gathered units (two blocks and the embedders / final layers) are under 10 % of the base
    assert one["weights_gb"] / 2 < two["weights_gb"] < 0.6 * one["weights_gb"]
    assert two["lora_and_optimizer_gb"] == pytest.approx(one["lora_and_optimizer_gb"] / 2, rel=1e-12)
    # batch 2 over 2 processes: one item each, the activations and transients of the unsharded batch-1 run
    assert (two["activations_gb"], two["transient_gb"]) == (one["activations_gb"], one["transient_gb"])
    assert two["total_gb"] == pytest.approx(two["weights_gb"] + two["lora_and_optimizer_gb"] + two["activations_gb"]
                                            + two["transient_gb"], rel=1e-12)
    four = _est(flux_dev, _sharded(4))
    assert four["weights_gb"] == pytest.approx(two["weights_gb"] - one["weights_gb"] / 4, rel=1e-12)
    # one process shards nothing: the unsharded estimate
    assert _est(flux_dev, _sharded(1)) == _est(flux_dev, _cfg(gradient_checkpointing=True, batch_size=1))


def test_data_parallel_activations_are_a_process_share_of_the_batch(flux_dev):
    """train.batch_size is split across train.num_processes (tasks/training/batches.py my_share): each process's
    activations are those of ceil(batch / N) items, sharded or not."""
    one = _est(flux_dev, _cfg(gradient_checkpointing=True, batch_size=1))
    dp = _est(flux_dev, _cfg(gradient_checkpointing=True, batch_size=4, num_processes=4))
    assert dp["activations_gb"] == one["activations_gb"] and dp["weights_gb"] == one["weights_gb"]
    three = _est(flux_dev, _cfg(gradient_checkpointing=True, batch_size=3, num_processes=2))  # 2 + 1 items
    assert three["activations_gb"] == pytest.approx(2 * one["activations_gb"], rel=1e-12)


def test_shard_offload_keeps_the_shards_on_the_host(flux_dev):
    two = _est(flux_dev, _sharded(2))
    off = _est(flux_dev, _sharded(2, shard_offload=True))
    assert off["weights_gb"] == pytest.approx(two["gathered_gb"], rel=1e-12)  # the card: the gathered units only
    assert off["lora_and_optimizer_gb"] == 0
    assert off["host_gb"] == pytest.approx(two["shard_gb"] + two["lora_and_optimizer_gb"], rel=1e-12)
    assert off["total_gb"] < two["total_gb"] - two["shard_gb"] + 1e-9


def test_communication_per_step(flux_dev):
    """Every block gathered in forward and again in backward, the root once; the LoRA's fp32 gradients
    reduce-scattered; a ring moves (N-1)/N into each process."""
    one = _est(flux_dev, _cfg(gradient_checkpointing=True))
    for n in (2, 4):
        e = _est(flux_dev, _sharded(n))
        moved = (n - 1) / n
        assert e["reduce_scatter_gb"] * GB == pytest.approx(one["lora_params"] * 4 * moved, rel=1e-12)
        # about twice the base: the root (embedders, final layers) is gathered once, not twice (within 5 %)
        assert e["allgather_gb"] == pytest.approx(2 * one["weights_gb"] * moved, rel=0.05)


def test_host_memory_of_a_machine_loading_one_process_after_another(flux_dev):
    from tasks.training.host_memory import PROCESS_GB, host_need

    cfg = _sharded(2)
    est = _est(flux_dev, cfg)
    need = host_need(cfg, est, 0.5)
    whole = est["unsharded_weights_gb"] + est["lora_params"] * 4 / GB
    assert need["host_need_gb"] == pytest.approx(2 * PROCESS_GB + whole + 0.5, rel=1e-12)  # one whole base at a time
    off = updated(cfg, {"train.shard_offload": True})
    e = _est(flux_dev, off)
    assert host_need(off, e, 0.5)["host_need_gb"] == pytest.approx(2 * PROCESS_GB + whole + 0.5 + e["shard_gb"],
                                                                  rel=1e-12)  # and the first process's shard
    two_machines = updated(_sharded(4), {"train.num_machines": 2})
    assert host_need(two_machines, _est(flux_dev, two_machines), 0.5)["host_machine_processes"] == 2


def test_validate_names_the_shard_count_that_fits(flux_dev):
    """One card of 16 GiB: bf16 + checkpointing (25.6 GiB) does not fit; validate names the single-card settings and
    beside them the smallest shard count that fits (2: 15.5 GiB each); a sharded run that does not fit, a larger N."""
    adapter = FluxAdapter(flux_dev, "bfloat16", 512)
    base = updated(_cfg(gradient_checkpointing=True), {"train.memory_limit_gb": 16.0})
    with pytest.raises(ConfigError) as e:
        preflight(base, adapter, (1024, 1024))
    targets = adapter.default_lora_targets()  # what validate's preflight trains: the family's default targets
    two = _est(flux_dev, _sharded(2), targets)
    assert "would fit: " in str(e.value)
    assert (f"over GPUs: train.shard=fsdp train.num_processes=2 train.batch_size=2 (2 GPUs of this size: "
            f"{two['total_gb']:.1f} GiB each)") in str(e.value)
    with pytest.raises(ConfigError) as e:
        preflight(updated(_sharded(2), {"train.memory_limit_gb": 12.0}), adapter, (1024, 1024))
    four = _est(flux_dev, _sharded(4), targets)
    assert f"over more GPUs: train.num_processes=4 train.batch_size=4 (4 GPUs of this size: {four['total_gb']:.1f}" \
        in str(e.value)
    assert "model.quantize=int8" not in str(e.value)  # int8 cannot shard: never named for a sharded run
    # 10 GiB: four GPUs hold it with the shards on them; two with the shards on the host (named too: fewer GPUs)
    with pytest.raises(ConfigError) as e:
        preflight(updated(base, {"train.memory_limit_gb": 10.0}), adapter, (1024, 1024))
    off = _est(flux_dev, _sharded(2, shard_offload=True), targets)
    assert (f"over GPUs: train.shard=fsdp train.num_processes=4 train.batch_size=4 (4 GPUs of this size: "
            f"{four['total_gb']:.1f} GiB each); or train.shard=fsdp train.num_processes=2 train.batch_size=2 "
            f"train.shard_offload=true (2 GPUs of this size: {off['total_gb']:.1f} GiB each, {off['host_gb']:.1f} GiB "
            "of host memory each)") in str(e.value)
    # a budget nothing fits, on one card or eight: no shard count named
    with pytest.raises(ConfigError) as e:
        preflight(updated(base, {"train.memory_limit_gb": 1.0}), adapter, (1024, 1024))
    assert "train.shard=fsdp" not in str(e.value)


def test_bench_rows_parse_fsdp():
    from bench.family_models import parse, train_config
    from bench.memory_shard import _sharded, base_name

    opts = parse("bf16+ckpt+fsdp2")
    assert (opts["store"], opts["ckpt"], opts["shards"], opts["shard_offload"], opts["offload"]) == \
        ("bf16", True, 2, False, False)
    opts = parse("nf4+ckpt+offload+shardoffload+fsdp4")
    assert (opts["shards"], opts["shard_offload"], opts["offload"]) == (4, True, True)
    assert parse("nf4+ckpt")["shards"] == 1
    tc = train_config(parse("bf16+ckpt+shardoffload+fsdp4"), 512, 16).train
    assert (tc.shard, tc.num_processes, tc.batch_size, tc.shard_offload) == ("fsdp", 4, 4, True)
    assert train_config(parse("bf16+ckpt"), 512, 16).train.shard == "none"
    assert base_name("flux2_dev:bf16+ckpt+shardoffload+fsdp4") == "flux2_dev:bf16+ckpt"
    assert _sharded("bf16+ckpt+shardoffload", 2) == "bf16+ckpt+shardoffload+fsdp2"


def test_the_committed_sharded_rows():
    """bench/memory.json's +fsdpN rows (derived from their unsharded rows, bench/memory_shard.py): the issue's five,
    per process, the preflight within PREFLIGHT_WITHIN of the derived peak (tests/test_bench_memory.py recomputes each
    preflight), the communication's seconds its bytes over the stated links."""
    from bench.memory_shard import LINKS, SHARD_ROWS

    doc = json.loads(MEASURED.read_text())
    rows = {r["name"]: r for r in doc["configs"]}
    for name in ("flux2_dev:bf16+ckpt+fsdp2", "flux2_dev:bf16+ckpt+fsdp4", "qwenimage:bf16+ckpt+fsdp2",
                 "wan14b_81f:bf16+ckpt+fsdp2", "flux2_dev:nf4+ckpt+fsdp2"):
        assert name in SHARD_ROWS and name in rows, name
    for name in SHARD_ROWS:
        r = rows[name]
        assert r["derived"] and r["shards"] == int(name.rsplit("fsdp", 1)[1])
        assert r["preflight_gib"] == pytest.approx(r["peak_gib"], rel=PREFLIGHT_WITHIN), name
        assert r["preflight_gib"] < r["unsharded_peak_gib"], name
        c = r["comm"]
        for link, bw in LINKS.items():
            assert c[f"{link}_s"] == pytest.approx((c["allgather_gb"] + c["reduce_scatter_gb"]) * 1e9 / bw, rel=1e-12)
        # the module tree's bytes (torchao's NF4 tensors) against the preflight's formula: within 1 %
        assert c["allgather_gb"] == pytest.approx(c["preflight_allgather_gb"], rel=0.01), name


def test_the_goals_on_the_preflight(tmp_path):
    """Issue 63's goals, per GPU on the preflight (1 GiB of each card left for the CUDA context): FLUX.2 [dev] bf16 on
    2 x 48 GB, Wan 2.1 14B at 81 frames bf16 on 2 x 48 GB; FLUX.2 [dev] bf16 on 4 x 24 GB and Qwen-Image bf16 on
    2 x 24 GB only with the shards on the host (train.shard_offload)."""
    from bench.memory_families import preflight as row_preflight

    def budget(gb):
        return gb * 1e9 / GIB - 1.0

    for name in ("flux2_dev:bf16+ckpt+fsdp2", "wan14b_81f:bf16+ckpt+fsdp2"):
        assert row_preflight(name, tmp_path)["total_gb"] <= budget(48), name
    for name in ("flux2_dev:bf16+ckpt+fsdp4", "qwenimage:bf16+ckpt+fsdp2"):
        assert row_preflight(name, tmp_path)["total_gb"] > budget(24), name
    for name in ("flux2_dev:bf16+ckpt+shardoffload+fsdp4", "qwenimage:bf16+ckpt+shardoffload+fsdp2"):
        assert row_preflight(name, tmp_path)["total_gb"] <= budget(24), name


def test_the_card_tables_multi_gpu_columns(tmp_path):
    """`shard_cards` in bench/memory.json (the card table's 2 x 24, 4 x 24 and 2 x 48 GB columns): each train setting is
    a sharded bench row whose preflight fits one of the column's cards with the CUDA context's GiB left, and the
    whole run's setting is what bench.memory_shard picks now (recomputed here for Qwen-Image)."""
    from bench.memory_nodes import MARGIN_GIB, card_text
    from bench.memory_shard import SHARD_CARDS, SHARD_ROWS, shard_cards

    doc = json.loads(MEASURED.read_text())
    rows = {r["name"]: r for r in doc["configs"]}
    for key, per in doc["shard_run_cards"].items():
        assert set(per) == {label for label, _, _ in SHARD_CARDS}
        for label, n, gb in SHARD_CARDS:
            advice = per[label]
            assert doc["shard_cards"][key][label] == card_text(advice)
            if advice["setting"] is None:
                continue
            model = key.replace("_both", "")
            name = f"{model}:{advice['setting']['train']}"
            assert name in SHARD_ROWS and name.endswith(f"+fsdp{n}"), name
            assert rows[name]["preflight_gib"] <= gb * 1e9 / GIB - MARGIN_GIB, name
    text, _ = shard_cards(tmp_path, keys=["qwenimage"])
    assert text["qwenimage"] == doc["shard_cards"]["qwenimage"]
