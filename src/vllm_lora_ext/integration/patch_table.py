"""``PATCHES.md``'s table, generated from ``plugin.PATCHES``.

``python -m vllm_lora_ext.integration.patch_table [PATH]`` rewrites the table in place (``PATH`` defaults to the
``PATCHES.md`` beside this module); ``tests/integration/test_plugin.py`` fails while the file differs from what
this module renders. The table lies between ``<!-- generated: patch-table -->`` and ``<!-- end: patch-table -->``;
the prose around it is written by hand.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

from vllm_lora_ext._util import replace_generated
from vllm_lora_ext.integration.patching import Patch

__all__ = ["PART", "render_patch_table", "render_patches_md"]

PART = "patch-table"
_HEADER = ("| # | target | process | checked parameters | reads (vLLM private) | writes onto vLLM objects | why | "
           "delete when | upstream |")


def _codes(names: Sequence[str]) -> str:
    return ", ".join(f"`{n}`" for n in names) if names else "—"


def _row(number: int, patch: Patch) -> str:
    cells = [str(number), f"`{patch.name}`", patch.process, _codes(patch.params), _codes(patch.reads),
             _codes(patch.writes), patch.why, patch.delete_when, patch.related or "—"]
    return "| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |"


def render_patch_table(patches: Sequence[Patch]) -> str:
    """Return the markdown table of ``patches``, one row each, in the order ``register()`` applies them."""
    rows = [_row(i, patch) for i, patch in enumerate(patches, 1)]
    return "\n".join([_HEADER, "|" + "---|" * _HEADER.count(" | ") + "---|", *rows])


def render_patches_md(text: str, patches: Sequence[Patch]) -> str:
    """Return ``text`` (a ``PATCHES.md``) with its table rendered anew from ``patches``.

    Raises:
        ValueError: ``text`` has no generated part.
    """
    return replace_generated(text, PART, render_patch_table(patches), what="PATCHES.md")


def main(argv: Sequence[str]) -> None:
    """Rewrite the table of the ``PATCHES.md`` at ``argv[0]`` (default: beside this module)."""
    from vllm_lora_ext.integration.plugin import PATCHES

    path = Path(argv[0]) if argv else Path(__file__).with_name("PATCHES.md")
    path.write_text(render_patches_md(path.read_text(), PATCHES))


if __name__ == "__main__":  # pragma: no cover
    main(sys.argv[1:])
