"""The docs' other checkable text: ```python and ```yaml blocks, the settings named in the prose, and the links
between pages (README.md and docs/*.md). Their shell commands: tests/test_docs_commands.py."""
from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest
import yaml

from support import MISSPELT_ON_PURPOSE, REPO, SECTIONS
from support import Block, DOCS, check_overrides, doc_blocks  # noqa: F401


# ---------------------------------------------------------------- python and yaml blocks, keys in the prose
def _other_blocks(lang: str) -> list[Block]:
    return [b for b in doc_blocks() if b.lang == lang]


@pytest.mark.parametrize("block", _other_blocks("python"), ids=lambda b: b.origin)
def test_python_blocks_import_and_compose(block, cuda):
    """A ```python block compiles, its `from X import Y` resolve, and the overrides it passes compose."""
    tree = ast.parse("\n".join(t for _, t in block.lines), block.origin)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            module = importlib.import_module(node.module)
            for alias in node.names:
                assert hasattr(module, alias.name), f"{block.origin}: {node.module} has no {alias.name}"
        if isinstance(node, ast.Call):
            kw = {k.arg: k.value for k in node.keywords}
            if "overrides" in kw:
                name = ast.literal_eval(kw["config_name"]) if "config_name" in kw else "train"
                check_overrides(ast.literal_eval(kw["overrides"]), block.origin, name)


@pytest.mark.parametrize("block", _other_blocks("yaml"), ids=lambda b: b.origin)
def test_yaml_blocks_are_config(block):
    """A ```yaml block (a config group file's content) merges, typed, into the section whose keys it has."""
    from omegaconf import OmegaConf

    from tasks.config import compose, known_keys

    keys, _ = known_keys()
    text = "\n".join(t for _, t in block.lines)
    content = yaml.safe_load(text)
    sections = {s for k in content for s in SECTIONS if f"{s}.{k}" in keys}
    assert len(sections) == 1, f"{block.origin}: keys {list(content)} are in sections {sections or 'none'}"
    cfg, _ = compose("train", [])
    OmegaConf.merge(cfg[sections.pop()], content)


def test_config_keys_named_in_the_prose_exist():
    """Every `section.key` in the docs' inline code is a setting (`data.caption_*` matches some), save the
    misspelling shown on purpose."""
    from tasks.config import known_keys

    keys, open_sections = known_keys()
    wrong = []
    for path in DOCS:
        prose = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
        for span in re.findall(r"`([^`\n]+)`", prose):
            for key in re.findall(r"(?<![\w./])((?:%s)\.[a-z_*][\w.*]*)" % "|".join(SECTIONS), span):
                key = key.rstrip(".")
                if key in MISSPELT_ON_PURPOSE or any(key.startswith(s + ".") for s in open_sections):
                    continue
                pattern = re.compile(re.escape(key).replace(r"\*", r"[\w.]*") + "$")
                if not any(pattern.match(k) for k in keys):
                    wrong.append(f"{path.relative_to(REPO)}: `{span}`: {key}")
    assert not wrong, "not a loraflow setting:\n" + "\n".join(wrong)


def _anchors(path: Path) -> set[str]:
    """GitHub's anchors for the headings of a page: lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in re.findall(r"^#+ (.+)$", text, re.M)}


def test_links_between_the_pages_resolve():
    """Every relative link of README.md and docs/ names a file that exists, and a heading of it when it has a
    #fragment: a page or section renamed breaks this, not a reader's click."""
    broken = []
    for path in DOCS:
        for target in re.findall(r"\]\(([^)\s]+)\)", path.read_text()):
            if re.match(r"[a-z]+://", target):
                continue
            file, _, fragment = target.partition("#")
            dest = (path.parent / file).resolve() if file else path
            if not dest.exists() or (fragment and dest.suffix == ".md" and fragment not in _anchors(dest)):
                broken.append(f"{path.relative_to(REPO)}: {target}")
    assert not broken, "broken links:\n" + "\n".join(broken)
