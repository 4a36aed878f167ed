"""The README's generated parts: the CLI summary (from the argparse parsers) and the environment-variable table
(from ``env_docs.ENV_DOCS``). ``python -m vllm_lora_ext.cli.readme [README.md]`` rewrites both in place;
``tests/core/test_readme.py`` fails while the README differs from what this module renders.

Each part lies between two HTML comments, ``<!-- generated: NAME -->`` and ``<!-- end: NAME -->``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from vllm_lora_ext._util import replace_generated

__all__ = ["render_cli_summary", "render_env_table", "render_readme"]

CLI_PART = "cli-summary"
ENV_PART = "env-table"


def _metavar(action: argparse.Action) -> str:
    if action.choices is not None and not isinstance(action.choices, dict):
        return "|".join(map(str, action.choices))
    if action.metavar is not None:
        return str(action.metavar)
    return action.dest.upper()


def _usage_part(action: argparse.Action) -> str:
    if not action.option_strings:
        text = _metavar(action)
        return f"{text} [{text} ...]" if action.nargs in ("+", "*") else text
    name = action.option_strings[0]
    text = name if action.nargs == 0 else f"{name} {_metavar(action)}"
    return text if action.required else f"[{text}]"


def _option_name(action: argparse.Action) -> str:
    if not action.option_strings:
        return f"`{_metavar(action)}`"
    names = list(action.option_strings)
    if action.nargs != 0:
        names[-1] += f" {_metavar(action)}"
    return ", ".join(f"`{n}`" for n in names)


def _arguments(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions
            if not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction)) and a.help != argparse.SUPPRESS]


def render_cli_summary() -> str:
    """Return the markdown summary of every ``vllm-lora`` command and option, from the parsers themselves."""
    from vllm_lora_ext.cli import _parser

    parser = _parser()
    top = _arguments(parser)
    lines = [f"- `vllm-lora {' '.join(_usage_part(a) for a in top)} COMMAND ...`: "
             + "; ".join(f"{_option_name(a)}: {a.help}" for a in top) + "."]
    lines += _commands(parser, "vllm-lora")
    return "\n".join(lines)


def _commands(parser: argparse.ArgumentParser, prefix: str) -> list[str]:
    """One entry per subcommand of ``parser``, nested commands (``cache ls``) included, each with its options."""
    subs = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
    if subs is None:
        return []
    helps = {c.dest: c.help for c in subs._choices_actions}
    lines = []
    for name, sub in subs.choices.items():
        args = _arguments(sub)
        nested = any(isinstance(a, argparse._SubParsersAction) for a in sub._actions)
        usage = " ".join([*(_usage_part(a) for a in args), *(["COMMAND ..."] if nested else [])])
        lines.append(f"- `{prefix} {name} {usage}`: {helps.get(name) or ''}.")
        if sub.description:
            lines.append(f"  {sub.description}")
        lines += [f"  - {_option_name(a)}: {a.help}" for a in args if a.help]
        lines += _commands(sub, f"{prefix} {name}")
    return lines


def render_env_table() -> str:
    """Return the markdown table of every ``VLLM_LORA_EXT_*`` variable, from ``env_docs.ENV_DOCS``."""
    from vllm_lora_ext.env_docs import ENV_DOCS

    rows = [f"| `{name}{setting}` | {effect} |" for name, (setting, effect) in ENV_DOCS.items()]
    return "\n".join(["| variable | effect |", "|---|---|", *rows])


def render_readme(text: str) -> str:
    """Return ``text`` (a README) with both generated parts rendered anew."""
    text = replace_generated(text, CLI_PART, render_cli_summary(), what="README")
    return replace_generated(text, ENV_PART, render_env_table(), what="README")


if __name__ == "__main__":  # pragma: no cover
    ap = argparse.ArgumentParser(prog="python -m vllm_lora_ext.cli.readme",
                                 description="Rewrite the README's generated parts (the CLI summary and the "
                                             "environment-variable table) in place.")
    ap.add_argument("readme", nargs="?", default="README.md", help="the README to rewrite (default: README.md)")
    path = Path(ap.parse_args().readme)
    path.write_text(render_readme(path.read_text()))
