"""The caption node's parts (tasks/caption.py is the node): which images need a caption (select.py), the
captioners (a local vision-language model, vlm.py; an OpenAI-compatible server, endpoint.py) and the caption
files written outside the store (files.py)."""
from __future__ import annotations

from tasks.config import ConfigError


class CaptionError(ConfigError):
    """A captioner cannot caption (no such model, a server that errs or does not answer): the user's to fix,
    one line, exit code 2. Captions finished before it stay stored."""
