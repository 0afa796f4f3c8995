"""The hub's tokenizers: every listed model's, parsed once and kept in the server process.

NOTE(hub): ``tokenizers`` parses a tokenizer.json holding the interpreter lock the whole time (0.9 s for Gemma 3's
262k tokens on a quiet core), so a model loaded on demand would stall every stream the server process is sending
meanwhile. Each listed model on disk has its tokenizer parsed right after start-up (in a worker thread) and kept
(engine.tokenizer.HeldTokenizers); a model pulled or converted on its first request is kept after that load. Loading
a model then parses nothing in this process. The cost is memory: about 130 MiB of RSS for Gemma 3's vocabulary,
10-20 MiB for 50k-token ones, for as long as the model is listed.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from server.hub.catalog import CatalogModel, folder_on_disk

logger = logging.getLogger("ortserve.hub")


def hold_listed(models: list[CatalogModel]) -> list[str]:
    """Parse and keep the tokenizer of each model already on disk (blocking: run it in a worker thread); returns
    the names of the models whose tokenizer is held."""
    from engine.tokenizer import HELD_TOKENIZERS

    started, held = time.monotonic(), []
    for model in models:
        folder = folder_on_disk(model)
        if folder is None or not (Path(folder) / "tokenizer.json").is_file():
            continue
        try:
            HELD_TOKENIZERS.hold(Path(folder) / "tokenizer.json")
        except Exception as exc:  # the load reports a bad tokenizer; holding is only ahead of it
            logger.warning("model %s: its tokenizer was not read ahead of loading: %s", model.name, exc)
            continue
        held.append(model.name)
    if held:
        logger.info("read the tokenizers of %d models in %.1f s and keep them (%s): loading a model parses none "
                    "beside running streams", len(held), time.monotonic() - started, ", ".join(held))
    return held


def hold_loaded(model: CatalogModel, loaded: Any) -> None:
    """Keep a loaded model's tokenizer (``loaded``: its engine or embedder) if it is not held yet: a model that was
    not on disk when the server started."""
    from engine.tokenizer import HELD_TOKENIZERS

    tokenizer, folder = getattr(loaded, "tokenizer", None), model.folder
    if tokenizer is None or folder is None or not (Path(folder) / "tokenizer.json").is_file():
        return
    HELD_TOKENIZERS.hold(Path(folder) / "tokenizer.json", tokenizer)  # keeps the one held, if any
