"""What a run would do, without doing it (like `dvc status`).

    python -m flows.explain [hydra overrides]          # a table
    python -m flows.explain --json [hydra overrides]   # the same as JSON
    python -m flows.explain --config-name NAME [...]   # another config in conf/ (default: train)

For each node: whether it would run or hit the store, how many items it would compute and reuse, and
which inputs changed since the last run with the same config name (the store's record, as
flows/train.py writes it). Nothing is encoded, trained or sampled: the validate node's plain function
reads the files (and builds the tiny model into the store if it is not there yet, as any run would),
then every key is computed with the nodes' own plain functions and looked up in the store, digests
checked. Prefect is not involved.

`validate` always runs in a real run (it is what finds changes); it is listed as `run` with the number
of images it checks, as the run report counts it.
"""
from __future__ import annotations

import json
import logging
import sys

from flows.errors import USER_ERRORS
from tasks import caption, cache_latents, cache_text, sample, train, validate
from tasks.config import Config, compose, resolve_paths
from tasks.store.hashing import changed_inputs, key_of
from tasks.report import NODES, readable_changes
from tasks.store.remote_store import open_store
from tasks.store import Store

SHOWN_CHANGES = 5


def _normal(inputs: dict) -> dict:
    """Inputs as the store's record holds them (JSON), so a tuple is not 'changed' against a list."""
    return json.loads(json.dumps(inputs, default=str))


def _items(store: Store, kind: str, keys) -> tuple[int, int]:
    """(compute, reuse) over distinct keys, as a run counts them: an entry whose files are as they were when
    last verified is answered from stat calls (tasks/store/entry_index.py), any other is verified, and one that
    fails is counted as compute (unlike a run, explain leaves it in place and writes no index)."""
    distinct = list(dict.fromkeys(keys))
    seen = store.unchanged(kind, distinct)
    reuse = sum(k in seen or (store.exists(kind, k) and store.intact(kind, k)) for k in distinct)
    return len(distinct) - reuse, reuse


def _continuation(store: Store, cfg: Config, node_inputs: dict) -> int:
    """The step a training run would continue from (0: from scratch); read-only."""
    tc = cfg.train
    if tc.resume != "auto":
        return 0
    return train.latest_checkpoint(store, train.trajectory_key(node_inputs, tc), int(tc.max_steps), discard=False)


def _entry(compute: int, reuse: int, before: dict | None, after: dict, **extra) -> dict:
    return {"would": "run" if compute else "hit", "compute": compute, "reuse": reuse,
            "changed": changed_inputs(before, _normal(after)), **extra}


def explain(config_name: str = "train", overrides: list[str] | None = None) -> dict:
    """Per node: would it run or hit, items it would compute / reuse, inputs changed since the last run
    of `config_name`. Raises the run's user errors (ConfigError, DatasetError, FileNotFoundError)."""
    cfg_node, _run_dir = compose(config_name, overrides)  # hydra.run.dir is accepted and ignored
    cfg = resolve_paths(cfg_node)
    store = open_store(cfg.store)
    record = store.read_record(config_name)
    previous = (record or {}).get("inputs", {})

    # the caption node: the captions the store holds; one it would make is a placeholder (its text is unknown:
    # the texts and everything downstream of it count as work, as they would be)
    wanted, caption_keys, caption_inputs, _ = caption.planned(cfg, store)
    stored = caption.stored_captions(store, wanted, caption_keys)
    made = {**{w.image: f"<caption of {w.name} to be made>" for w in wanted}, **stored}
    plan = validate.run(cfg, store, made if cfg.data.captions != "file" else None)
    latent_keys = cache_latents.item_keys(cfg, plan)
    text_keys = cache_text.item_keys(cfg, plan)
    train_inputs = train.inputs(cfg, plan, latent_keys, text_keys)
    lora_key = key_of(train_inputs)
    sample_keys = sample.item_keys(cfg, plan, lora_key, text_keys)

    compute, reuse = _items(store, caption.KIND, caption_keys.values())
    if cfg.data.captions == "regenerate":
        compute, reuse = compute + reuse, 0
    nodes = {"caption": _entry(compute, reuse, previous.get("caption"), caption_inputs, key=key_of(caption_inputs))}
    nodes["validate"] = _entry(validate.images(plan), 0, previous.get("validate"), validate.inputs(plan))
    nodes["cache_latents"] = _entry(*_items(store, cache_latents.KIND, latent_keys.values()),
                                    previous.get("cache_latents"), cache_latents.inputs(cfg, plan),
                                    key=cache_latents.key_of_node(cfg, plan))
    nodes["cache_text"] = _entry(*_items(store, cache_text.KIND, text_keys.values()),
                                 previous.get("cache_text"), cache_text.inputs(cfg, plan),
                                 key=cache_text.key_of_node(cfg, plan))
    compute, reuse = _items(store, train.KIND, [lora_key])
    nodes["train"] = _entry(compute, reuse, previous.get("train"), train_inputs, key=lora_key)
    if compute:
        nodes["train"]["continues_from_step"] = _continuation(store, cfg, train_inputs)
    nodes["sample"] = _entry(*_items(store, sample.KIND, sample_keys.values()), previous.get("sample"),
                             sample.inputs(cfg, plan, lora_key, text_keys),
                             key=sample.key_of_node(cfg, plan, lora_key, text_keys))
    for e in nodes.values():  # the table names them as a run's log does ("image or caption img_03.png")
        e["changed_readable"] = list(dict.fromkeys(
            readable_changes([n], cfg.sample.prompts_file, cfg.data.caption_extension) for n in e["changed"]))
    return {"config_name": config_name, "store": str(store.root), "previous_run": record is not None,
            "nodes": {n: nodes[n] for n in NODES}, "warnings": plan.warnings}


def format_table(result: dict) -> str:
    rows = [("node", "would", "compute", "reuse", "changed since the last run")]
    for name, e in result["nodes"].items():
        would = e["would"]
        if name == "validate":
            would = "run (always)"
        elif e.get("continues_from_step"):
            would = f"run (continues from step {e['continues_from_step']})"
        names = e.get("changed_readable", e["changed"])
        changed = ", ".join(names[:SHOWN_CHANGES])
        if len(names) > SHOWN_CHANGES:
            changed += f", ... (+{len(names) - SHOWN_CHANGES} more)"
        rows.append((name, would, str(e["compute"]), str(e["reuse"]), changed or "-"))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = ["  ".join(c.ljust(w) if i == 0 or i == 1 else c.rjust(w) for i, (c, w) in enumerate(zip(r[:4], widths)))
             + "  " + r[4] for r in rows]
    lines.insert(1, "-" * (sum(widths) + 8 + len(rows[0][4])))
    head = f"loraflow explain: config {result['config_name']!r}, store {result['store']}"
    if not result["previous_run"]:
        head += f"\n(no previous run of {result['config_name']!r} in this store: nothing to compare inputs with)"
    work = [n for n, e in result["nodes"].items() if n != "validate" and e["would"] == "run"]
    tail = ("up to date: a run would reuse everything" if not work
            else f"a run would compute in: {', '.join(work)}")
    return "\n".join([head, "", *lines, "", tail])


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] in ("-h", "--help"):
        print(__doc__.strip())
        return 0
    as_json, config_name, overrides = False, "train", []
    it = iter(args)
    for a in it:  # --json, Hydra's --config-name/-cn; everything else is an override
        if a == "--json":
            as_json = True
        elif a in ("--config-name", "-cn"):
            config_name = next(it, config_name)
        elif a.startswith("--config-name="):
            config_name = a.split("=", 1)[1]
        else:
            overrides.append(a)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        result = explain(config_name, overrides)
    except USER_ERRORS as e:  # bad data or config: the message names the file/key and the fix
        print(f"loraflow explain: {e}", file=sys.stderr)
        return 2
    print(json.dumps(result, indent=2) if as_json else format_table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
