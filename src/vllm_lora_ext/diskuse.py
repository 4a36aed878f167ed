"""Which cached hub revisions a server's adapters keep in use, as plain data.

A server holds, in the shared disk cache ([`diskholds`]), every hub revision that a registered adapter or
a live mix points at: a worker may rebuild any of them from disk at any time (its CPU cache is bounded), so
none may be evicted. Adapters registered at start-up (``--lora-modules``, the deployment config) are shown
as pinned. Pure core: the server passes its registered ``name -> lora_path`` map.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping

from vllm_lora_ext.constants import MIX_PREFIX
from vllm_lora_ext.diskholds import HeldSources
from vllm_lora_ext.mixing import MixSpec
from vllm_lora_ext.sources import parse_source

__all__ = ["revisions_in_use", "sync_server_holds"]

logger = logging.getLogger(__name__)


def revisions_in_use(paths: Mapping[str, str], *, pinned: Collection[str] = ()) -> dict[tuple[str, str | None], str]:
    """Return ``(repo_id, revision) -> why`` for every hub source the registered ``name -> lora_path`` map uses.

    A ``mix:`` path uses each of its components' sources. A path that does not parse is skipped (it was
    refused when it was registered, or it is not this plugin's).

    Example:
        >>> sha = "0" * 40
        >>> revisions_in_use({"sql": f"hf:acme/sql@{sha}", "local": "/srv/lora"}, pinned={"sql"})
        {('acme/sql', '0000000000000000000000000000000000000000'): "adapter 'sql' (pinned at start-up)"}
    """
    wanted: dict[tuple[str, str | None], str] = {}
    for name, path in sorted(paths.items()):
        try:
            sources = [c.source for c in MixSpec.from_path(path).components] if path.startswith(MIX_PREFIX) else [path]
            parsed = [parse_source(s) for s in sources]
        except Exception as err:  # bookkeeping never fails a registration
            logger.debug("adapter %r: path not counted for the disk cache: %s", name, err)
            continue
        what = "mix" if path.startswith(MIX_PREFIX) else "adapter"
        why = f"{what} {name!r} ({'pinned at start-up' if name in pinned else 'registered'})"
        for src in parsed:
            if src.kind == "hf" and src.repo_id:
                wanted.setdefault((src.repo_id, src.revision), why)
    return wanted


def sync_server_holds(held: HeldSources, paths: Mapping[str, str], *, pinned: Collection[str] = ()) -> None:
    """Make ``held`` hold exactly the revisions [`revisions_in_use`] finds (blocking file I/O: run it in a thread)."""
    held.sync(revisions_in_use(paths, pinned=pinned))
