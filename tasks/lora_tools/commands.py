"""loraflow-lora (also `python -m tasks.lora_tools`): resize, merge, convert and extract LoRA files, and merge LoRAs
into their base model's denoiser. docs/lora-files.md has the commands and what each prints.

Bad input gives one line on stderr and exit code 2, never a traceback; outputs are written atomically, so a
failure or Ctrl-C leaves no partial file. Every subcommand's parser takes its options anywhere among the paths
(parse_intermixed_args), so `merge A B --weights 0.7,0.3 OUT` reads as written: the last path is the output."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tasks.lora_tools import models, names, ops
from tasks.lora_tools.lora_files import DIFFUSERS, FORMATS, KOHYA, LoraToolError, lora_metadata, read_lora, write_lora
from tasks.training.export import FAMILIES

PROG = "loraflow-lora"


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse's usage + message is two lines and exit 2; the CLI's rule is one line
        raise LoraToolError(f"{message} (see {self.prog} --help)")


def _positive(kind):
    def parse(text):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not value > 0:
            raise argparse.ArgumentTypeError(f"must be above 0, not {text}")
        return value
    return parse


def _parsers() -> dict[str, argparse.ArgumentParser]:
    def parser(name, help, description):
        p = _Parser(prog=f"{PROG} {name}", description=description)
        p.help_line = help
        return p

    def family(p, model=True):
        p.add_argument("--family", choices=FAMILIES, help="the base model's family, when the files' metadata "
                       "(ss_base_model_version) or the model folder do not say it")
        if model:
            p.add_argument("--model", metavar="MODEL_DIR", help="the base model's diffusers folder: its module names "
                           "and widths for a format conversion (default: the family's largest released layout)")

    def expert(p):
        p.add_argument("--expert", help="a model with several denoisers (Wan 2.2: high or low): the one to use")

    def fmt(p, default="the input's"):
        p.add_argument("--format", choices=FORMATS, help=f"output layout (default: {default})")

    rank = _positive(int)
    p_resize = parser("resize", "truncate each module to rank R (SVD)",
                      "Truncate each module's delta (alpha/rank * up @ down) to rank R by SVD: the best rank-R "
                      "approximation. Prints the share of the delta's energy (squared Frobenius norm) kept.")
    p_resize.add_argument("input", metavar="IN")
    p_resize.add_argument("out", metavar="OUT")
    p_resize.add_argument("--rank", type=rank, required=True, metavar="R")
    p_resize.add_argument("--alpha", type=_positive(float), help="output alpha (default: R, i.e. scale 1)")
    fmt(p_resize)
    family(p_resize)
    p_resize.add_argument("-v", "--verbose", action="store_true", help="one line per module")

    p_merge = parser("merge", "LoRAs -> one LoRA, or into the base model's denoiser",
                     "merge LORA... OUT: one LoRA whose delta is w1*delta1 + w2*delta2 + ... (ranks concatenated, "
                     "exact). merge LORA... --into-base MODEL_DIR OUT: the denoiser with the LoRAs merged into "
                     "its weights. The last path is the output.")
    p_merge.add_argument("paths", nargs="+", metavar="LORA... OUT")
    p_merge.add_argument("--weights", metavar="W1,W2,...", help="one weight per LoRA (default: 1 each)")
    p_merge.add_argument("--weight", type=float, metavar="W", help="the same as --weights with one LoRA")
    p_merge.add_argument("--rank", type=rank, metavar="R", help="re-compress the merged LoRA to rank R (SVD)")
    p_merge.add_argument("--into-base", metavar="MODEL_DIR", help="merge into this diffusers pipeline folder's "
                         "denoiser and write it as one file")
    p_merge.add_argument("--layout", choices=models.LAYOUTS, default=models.DIFFUSERS_LAYOUT,
                         help="--into-base output keys: diffusers (every family) or original (sd15, sdxl: "
                         "A1111's model.diffusion_model.*)")
    fmt(p_merge, "the first input's")
    family(p_merge)
    expert(p_merge)
    p_merge.add_argument("-v", "--verbose", action="store_true", help="one line per module")

    p_convert = parser("convert", "rewrite a LoRA in the other layout",
                       "Rewrite IN in the layout --format names (kohya <-> diffusers), the delta unchanged.")
    p_convert.add_argument("input", metavar="IN")
    p_convert.add_argument("out", metavar="OUT")
    p_convert.add_argument("--format", choices=FORMATS, required=True, help="output layout")
    family(p_convert)

    p_extract = parser("extract", "a LoRA from two models' difference (SVD per Linear)",
                       "A LoRA of rank R from tuned - base, per Linear of the denoiser (truncated SVD). BASE and "
                       "TUNED: diffusers folders of the same family, or single files in diffusers' key layout.")
    p_extract.add_argument("out", metavar="OUT")
    p_extract.add_argument("--base", required=True)
    p_extract.add_argument("--tuned", required=True)
    p_extract.add_argument("--rank", type=rank, required=True, metavar="R")
    p_extract.add_argument("--device", help="where the SVDs run (default: cuda when there is one, else cpu)")
    fmt(p_extract, "kohya")
    family(p_extract, model=False)
    expert(p_extract)
    p_extract.add_argument("-v", "--verbose", action="store_true", help="one line per module")
    return {"resize": p_resize, "merge": p_merge, "convert": p_convert, "extract": p_extract}


def _note(text: str) -> None:
    print(f"note: {text}", file=sys.stderr)


def _family(args, loras=(), model: tuple[str, str | None] = ("", None), needed: bool = True) -> str | None:
    """The one family that --family, the LoRAs' metadata and the base model agree on; None if none says and none
    is needed. Disagreement, or an unknown one where one is needed, is an error."""
    said = {"--family": args.family} if args.family else {}
    for lora in loras:
        if lora.family:
            said[str(lora.path)] = lora.family
        elif lora.said and needed:
            raise LoraToolError(f"{lora.path}: its metadata says ss_base_model_version={lora.said}, not a family "
                                f"loraflow-lora maps ({', '.join(FAMILIES)}); pass --family if it is one of them")
    if model[1]:
        said[model[0]] = model[1]
    if len(set(said.values())) > 1:
        raise LoraToolError("the family is not the same everywhere: " + ", ".join(f"{k} says {v}" for k, v in
                            said.items()) + " (LoRAs of another model, or a wrong --family)")
    if not said and needed:
        what = ", ".join(str(lora.path) for lora in loras) or "the models"
        raise LoraToolError(f"cannot tell the model family of {what} (no ss_base_model_version in the metadata): "
                            f"pass --family ({', '.join(FAMILIES)})")
    return next(iter(said.values()), None)


def _shapes(args, family):
    """(Linear shapes, exact) for a name conversion: --model's config, else the family's widest layout."""
    if getattr(args, "model", None):
        den = models.locate(args.model, "--model", any_expert=True)
        if den.family and den.family != family:
            raise LoraToolError(f"--model {args.model} is a {den.family} model, the LoRA is for {family}")
        return names.linear_shapes(family, den.config), den.config is not None
    return names.linear_shapes(family), False


def _in_format(lora, fmt: str, family: str | None, args) -> dict:
    """The LoRA's modules in the names of layout `fmt`."""
    if lora.format == fmt:
        return lora.modules
    shapes, exact = _shapes(args, family)
    if fmt == DIFFUSERS:
        return names.kohya_to_diffusers(lora.modules, family, shapes, exact, str(lora.path))
    modules, notes = names.diffusers_to_kohya(lora.modules, family, shapes, str(lora.path))
    for n in notes:
        _note(n)
    return modules


def _report(label: str, stats: dict, verbose: bool) -> None:
    """Energy (squared Frobenius norm) kept: per module with -v, the lowest module, and in total (energies of
    separate modules add)."""
    def share(k):
        return k.kept / k.total if k.total else 1.0
    if verbose:
        for name, k in stats.items():
            print(f"  {name}: rank {k.rank_in} -> {k.rank_out}, energy kept {100 * share(k):.4f} %")
    kept, total = sum(k.kept for k in stats.values()), sum(k.total for k in stats.values())
    low = min(stats, key=lambda n: share(stats[n]))
    ranks = sorted({k.rank_out for k in stats.values()})
    print(f"{label}: {len(stats)} modules to rank {ranks[-1] if len(ranks) == 1 else f'{ranks[0]}-{ranks[-1]}'}, "
          f"energy kept {100 * (kept / total if total else 1.0):.4f} % in total "
          f"(lowest {100 * share(stats[low]):.4f} %: {low})")


def _check_out(out: str, inputs) -> None:
    if any(Path(out).resolve() == Path(i).resolve() for i in inputs):
        raise LoraToolError(f"{out}: the output would overwrite an input; write to a new file")


def _resize(args) -> int:
    _check_out(args.out, [args.input])
    lora = read_lora(args.input)
    fmt = args.format or lora.format
    family = _family(args, [lora], needed=fmt != lora.format)
    if args.alpha and fmt == DIFFUSERS:
        _note("--alpha applies to kohya output; a diffusers file has its scale folded into lora_B (alpha = rank)")
    modules, stats = ops.resize(_in_format(lora, fmt, family, args), args.rank, args.alpha if fmt == KOHYA else None)
    _report(args.input, stats, args.verbose)
    meta = lora_metadata(modules, family, fmt, lora.metadata, loraflow_resized_from=Path(args.input).name)
    print(f"wrote {write_lora(args.out, modules, fmt, meta)} ({fmt}, {len(modules)} modules)")
    return 0


def _weights(args, n: int) -> list[float]:
    if args.weights is not None and args.weight is not None:
        raise LoraToolError("give --weights or --weight, not both")
    if args.weight is not None:
        text = [str(args.weight)]
    else:
        text = args.weights.split(",") if args.weights is not None else ["1"] * n
    try:
        weights = [float(t) for t in text]
    except ValueError:
        raise LoraToolError(f"--weights {args.weights}: not comma-separated numbers (e.g. 0.7,0.3)") from None
    if len(weights) != n:
        raise LoraToolError(f"--weights has {len(weights)} values for {n} LoRA file(s): one per LoRA, "
                            "and the last path is the output")
    return weights


def _merge(args) -> int:
    if len(args.paths) < 2:
        raise LoraToolError("merge: give the LoRA file(s) and then the output file")
    inputs, out = args.paths[:-1], args.paths[-1]
    _check_out(out, inputs)
    weights = _weights(args, len(inputs))
    if args.into_base:
        return _into_base(args, inputs, out, weights)
    if args.expert:
        raise LoraToolError("--expert picks the base model's denoiser: it applies with --into-base only")
    loras = [read_lora(p) for p in inputs]
    fmt = args.format or loras[0].format
    family = _family(args, loras, needed=any(lora.format != fmt for lora in loras))
    denoisers = {(lora.path, n.split(".", 1)[0]) for lora in loras if lora.format == DIFFUSERS for n in lora.modules
                 if not n.startswith("text_encoder")}
    if len({c for _, c in denoisers}) > 1:  # unet. and transformer. modules: no module would overlap
        raise LoraToolError("LoRAs of different models: " + ", ".join(f"{p} is for a {c}"
                                                                      for p, c in sorted(denoisers)))
    parts = [_in_format(lora, fmt, family, args) for lora in loras]
    merged = ops.merge(parts, weights, inputs)
    for path, part, w in zip(inputs, parts, weights):
        print(f"{path}: {len(part)} modules at weight {w:g}")
    if args.rank:
        merged, stats = ops.resize(merged, args.rank)
        _report("merged", stats, args.verbose)
    meta = lora_metadata(merged, family, fmt, loraflow_merged_from=[{"file": Path(p).name, "weight": w}
                                                                     for p, w in zip(inputs, weights)])
    print(f"wrote {write_lora(out, merged, fmt, meta)} ({fmt}, {len(merged)} modules)")
    return 0


def _into_base(args, inputs, out, weights) -> int:
    if args.format or args.rank or args.model:
        raise LoraToolError("--format, --rank and --model do not apply with --into-base (its output is a model; "
                            "--layout picks its keys)")
    den = models.locate(args.into_base, "--into-base", args.expert)
    if den.config is None:
        raise LoraToolError(f"--into-base {args.into_base}: give the model's diffusers folder, not a single file")
    loras = [read_lora(p) for p in inputs]
    family = _family(args, loras, ("--into-base", den.family))
    models.check_layout(args.layout, family)  # before the work
    state_dict = models.load_weights(den)
    shapes = names.weight_shapes(state_dict)
    for lora, w in zip(loras, weights):
        modules = {n: p for n, p in lora.modules.items() if not n.startswith(("lora_te", "text_encoder"))}
        if len(modules) < len(lora.modules):
            _note(f"{lora.path}: {len(lora.modules) - len(modules)} text-encoder modules left out (only the "
                  "denoiser is merged)")
        if lora.format == KOHYA:
            modules = names.kohya_to_diffusers(modules, family, shapes, True, str(lora.path))
        wrong = sorted({n.split(".", 1)[0] for n in modules} - {den.component})
        if wrong:
            raise LoraToolError(f"{lora.path}: a LoRA of {wrong[0]}, the model's denoiser is {den.component}: a LoRA "
                                "of another model?")
        n = ops.apply(state_dict, {k.split(".", 1)[1]: p for k, p in modules.items()}, w, str(lora.path))
        print(f"{lora.path}: {n} weights changed at weight {w:g}")
    meta = {"format": "pt", "loraflow_family": family, "loraflow_layout": args.layout,
            "loraflow_base_model": str(Path(args.into_base).name), **({"loraflow_expert": args.expert} if args.expert else {}),
            "loraflow_merged_loras": repr([(Path(p).name, w) for p, w in zip(inputs, weights)])}
    path = models.write_denoiser(out, state_dict, args.layout, family, den.config, meta)
    print(f"wrote {path} ({family} {den.files[0].parent.name}, {args.layout} layout, {len(state_dict)} tensors)")
    return 0


def _convert(args) -> int:
    _check_out(args.out, [args.input])
    lora = read_lora(args.input)
    family = _family(args, [lora], needed=args.format != lora.format)
    modules = _in_format(lora, args.format, family, args)
    meta = lora_metadata(modules, family, args.format, lora.metadata)
    print(f"wrote {write_lora(args.out, modules, args.format, meta)} ({args.format}, {len(modules)} modules)")
    return 0


def _extract(args) -> int:
    import torch

    base, tuned = models.locate(args.base, "--base", args.expert), models.locate(args.tuned, "--tuned", args.expert)
    _check_out(args.out, [*base.files, *tuned.files])
    fmt = args.format or KOHYA
    if base.family and tuned.family and base.family != tuned.family:
        raise LoraToolError(f"--base is a {base.family} model, --tuned a {tuned.family} one: give two models of "
                            "one family")
    config = base.config or tuned.config
    family = _family(args, (), ("--base", base.family or tuned.family), needed=fmt == KOHYA or config is None)
    component = base.component or tuned.component or names.denoiser_component(family)
    linears = names.linear_shapes(family, config)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    modules, stats, same = ops.extract(models.load_weights(base), models.load_weights(tuned), linears, args.rank,
                                       device)
    if not modules:
        raise LoraToolError(f"--base and --tuned have the same Linear weights ({len(same)}): nothing to extract")
    print(f"{len(modules)} of {len(linears)} Linears differ")
    _report("extracted", stats, args.verbose)
    modules = {f"{component}.{n}": p for n, p in modules.items()}
    if fmt == KOHYA:
        nameable = {f"{component}.{r}" for rows in names.kohya_groups(family, linears).values() for r in rows}
        if left := sorted(set(modules) - nameable):
            _note(f"{len(left)} changed Linears have no kohya name in {family} and are left out: "
                  f"{', '.join(left[:4])}{' ...' if len(left) > 4 else ''} (--format diffusers keeps them)")
        modules, notes = names.diffusers_to_kohya({n: p for n, p in modules.items() if n in nameable}, family,
                                                  linears, "--tuned")
        for n in notes:
            _note(n)
    meta = lora_metadata(modules, family, fmt, loraflow_extracted_from=[Path(args.base).name, Path(args.tuned).name])
    print(f"wrote {write_lora(args.out, modules, fmt, meta)} ({fmt}, {len(modules)} modules)")
    return 0


COMMANDS = {"resize": _resize, "merge": _merge, "convert": _convert, "extract": _extract}


def parse(argv: list[str]) -> argparse.Namespace:
    """The subcommand's arguments (raises LoraToolError on bad ones; exits after --help)."""
    parsers = _parsers()
    if not argv or argv[0] in ("-h", "--help"):
        print(f"usage: {PROG} {{{','.join(parsers)}}} ...\n\nLoRA file tools (docs/lora-files.md):")
        for name, p in parsers.items():
            print(f"  {name:8} {p.help_line}")
        raise SystemExit(0 if argv else 2)
    if argv[0] not in parsers:
        raise LoraToolError(f"unknown command {argv[0]!r}: one of {', '.join(parsers)}")
    args = parsers[argv[0]].parse_intermixed_args(argv[1:])
    args.command = argv[0]
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        args = parse(argv)
        return COMMANDS[args.command](args)
    except LoraToolError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # outputs are written to a temporary name and renamed: none is left half-written
        print(f"{PROG}: interrupted (no output is left half-written)", file=sys.stderr)
        return 130
    except OSError as e:  # disk full, permissions: one line too
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 1
