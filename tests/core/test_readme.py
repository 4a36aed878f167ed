"""The README says what the code does: its CLI summary is the argparse parsers', its variable table constants.py's,
its links land on headings, the patches it names exist, and its set-up section still holds the two one-line
commands CI runs."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from importlib.util import find_spec
from pathlib import Path

import pytest

from vllm_lora_ext import constants, env_docs
from vllm_lora_ext._util import generated_part
from vllm_lora_ext.cli.readme import CLI_PART, ENV_PART, render_cli_summary, render_env_table

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
FIX = "run `python -m vllm_lora_ext.cli.readme README.md` to regenerate it"


def test_readme_cli_summary_is_the_one_the_argparse_parsers_give() -> None:
    assert generated_part(README, CLI_PART) == render_cli_summary(), FIX


def test_readme_environment_table_is_the_one_constants_gives() -> None:
    assert generated_part(README, ENV_PART) == render_env_table(), FIX


def test_every_vllm_lora_ext_variable_in_the_code_has_a_row() -> None:
    named = {v for k, v in vars(constants).items() if k.startswith("ENV_") and isinstance(v, str)}
    used = {m for p in (ROOT / "src" / "vllm_lora_ext").rglob("*.py")
            for m in re.findall(r"\bVLLM_LORA_EXT_[A-Z][A-Z_]*[A-Z]\b", p.read_text())}
    assert (named | used) - set(env_docs.ENV_DOCS) == set()


def test_readme_links_to_its_own_sections_land_on_headings() -> None:
    def anchor(heading: str) -> str:
        return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")

    anchors = {anchor(h) for h in re.findall(r"^#+ (.+)$", README, re.M)}
    links = set(re.findall(r"\]\(#([^)]+)\)", README))
    assert links and links <= anchors, links - anchors


def test_readme_names_patches_by_their_targets_not_by_numbers_that_move() -> None:
    """Inserting a patch renumbers those after it in ``integration/PATCHES.md`` (r38 found five README numbers off by
    two), so the README names a patch by its target, and each target it names in backticks next to PATCHES.md is
    one of ``plugin.PATCHES``."""
    from vllm_lora_ext.integration import plugin

    assert re.findall(r"\b[Pp]atch(?:es)? \d+", README) == []
    targets = {p.target for p in plugin.PATCHES}
    named = set(re.findall(r"`([A-Za-z_.]+)`(?: in both modules)?, `integration/PATCHES\.md`|"
                           r"`([A-Za-z_.]+)` in `integration/PATCHES\.md`", README))
    named = {a or b for a, b in named}
    assert named and named <= targets, named - targets


def test_readme_set_up_section_still_holds_the_two_one_line_commands_ci_runs() -> None:
    section = README.split("## Set-up on a fresh machine", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```bash\n(.*?)\n```", section, re.S)
    assert [b.count("\n") for b in blocks] == [0, 0]
    assert blocks[0].endswith("vllm-lora inspect /tmp/demo-adapter") and "pytest" in blocks[1]


@pytest.mark.skipif(find_spec("ray") is not None, reason="Ray is installed here")
def test_the_ray_example_without_ray_says_it_needs_ray_serve_without_a_traceback(tmp_path: Path) -> None:
    (tmp_path / "c.yaml").write_text("adapters:\n  style: /srv/loras/style\n")  # read first: a bad one says so at once
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "ray_serve_llm.py"), "--model", "m", "--config",
                          str(tmp_path / "c.yaml")], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert out.stderr.startswith("error: this example needs Ray Serve LLM, which is not installed") and \
        "pip install 'vllm-lora-ext[ray]'" in out.stderr
    bad = subprocess.run([sys.executable, str(ROOT / "examples" / "ray_serve_llm.py"), "--model", "m", "--config",
                          str(tmp_path / "missing.yaml")], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    assert bad.returncode == 1 and "Traceback" not in bad.stderr
    assert bad.stderr.startswith(f"error: --config {tmp_path / 'missing.yaml'}: ")
    assert "VLLM_LORA_EXT_CONFIG" not in bad.stderr
