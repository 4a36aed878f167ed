"""The ``vllm-lora`` command: ``inspect``, ``fetch``, ``convert`` and ``mix`` (no GPU, no vLLM needed).

Exit codes: 0 ok, 1 the adapter, source or output failed (one ``error:`` line on stderr, never a
traceback; ``-vv`` adds it), 2 usage error, 130 interrupted. A closed stdout (``vllm-lora inspect X | head``)
ends the command quietly with 0. A warning raised by torch in this package's code (a tensor resized to fit,
say) is an error here: such a warning means a tensor would be written wrong.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
import traceback
import warnings
from collections.abc import Iterator, Sequence

from vllm_lora_ext.cli._args import one_line, plural, positive_int
from vllm_lora_ext.constants import check_settings
from vllm_lora_ext.errors import DiskCacheFullError, SettingsError, VllmLoraExtError

__all__ = ["main", "positive_int", "strict_warnings", "plural"]


def _parser() -> argparse.ArgumentParser:
    from vllm_lora_ext.cli import convert, fetch, inspect, mix

    p = argparse.ArgumentParser(prog="vllm-lora", description="Inspect, fetch, convert and mix LoRA adapters for vLLM.")
    p.add_argument("-v", "--verbose", action="count", default=0, help="more log output (-vv for debug)")
    p.add_argument("-q", "--quiet", action="store_true", help="log errors only (results still print)")
    from vllm_lora_ext import __version__

    p.add_argument("--version", action="version", version=f"vllm-lora {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    inspect.add_parser(sub)
    fetch.add_parser(sub)
    convert.add_parser(sub)
    mix.add_parser(sub)
    from vllm_lora_ext.cli import verify
    verify.add_parser(sub)

    from vllm_lora_ext.cli import cache as cache_cli  # the disk tier

    cache_cli.add_parser(sub)
    _flags_after(sub)
    return p


def _flags_after(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """The same -v/-q after a command (and a nested one): 'vllm-lora inspect -v X', 'vllm-lora cache ls -v'."""
    for command in sub.choices.values():
        command.add_argument("-v", "--verbose", action="count", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
        command.add_argument("-q", "--quiet", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
        command.set_defaults(_parser=command)  # the innermost command's parser names a flag it does not take
        for action in command._actions:
            if isinstance(action, argparse._SubParsersAction):
                _flags_after(action)


@contextlib.contextmanager
def _logging(verbose: int, quiet: bool, *, bars: bool = True) -> Iterator[None]:
    """Our log lines on stderr, once each: the package's logger gets one handler for the command's length, and
    huggingface_hub keeps its own (no root handler, which would print its retries a second time). Without
    ``bars`` (``-q``, ``--json``), huggingface_hub draws no download bars meanwhile."""
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars
    from huggingface_hub.utils import logging as hf_logging

    level = logging.ERROR if quiet else (logging.DEBUG if verbose > 1 else logging.INFO if verbose else logging.WARNING)
    ours = logging.getLogger("vllm_lora_ext")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    saved = (ours.level, ours.propagate, hf_logging.get_verbosity())
    ours.addHandler(handler)
    ours.setLevel(level)
    ours.propagate = False
    hf_logging.set_verbosity(logging.ERROR if quiet else logging.DEBUG if verbose > 1 else logging.WARNING)
    bars_were_off = are_progress_bars_disabled()
    if not bars:
        disable_progress_bars()
    try:
        yield
    finally:
        if not bars and not bars_were_off:
            enable_progress_bars()
        ours.removeHandler(handler)
        ours.setLevel(saved[0])
        ours.propagate = saved[1]
        hf_logging.set_verbosity(saved[2])


@contextlib.contextmanager
def strict_warnings() -> Iterator[None]:
    """Turn every ``UserWarning``/``RuntimeWarning`` raised from this package's code (torch's included: they carry
    the module of the Python line that called torch) into an error, for the block. Deprecation notices stay
    warnings: they never mean a tensor is wrong."""
    with warnings.catch_warnings():
        for category in (UserWarning, RuntimeWarning):
            warnings.filterwarnings("error", category=category, module=r"vllm_lora_ext(\.|$)")
        yield


def _quiet_stdout() -> None:
    """After a closed stdout: point it at /dev/null, so that the flush at exit raises nothing either."""
    try:
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, sys.stdout.fileno())
        os.close(null)
    except (OSError, ValueError):  # stdout is no real file (a test's capture): nothing is flushed at exit
        pass


def _settings_checked(quiet: bool) -> bool:
    """Check the settings (the CLI reads them too: the disk bound, the config) before huggingface_hub is imported (a
    malformed HF_ENDPOINT stops its import): a bad one is an ``error:`` line (``False``), an unknown one a
    ``warning:`` line."""
    said = logging.StreamHandler(sys.stderr)
    said.setFormatter(logging.Formatter("warning: %(message)s"))
    said.setLevel(logging.ERROR if quiet else logging.WARNING)
    settings_log = logging.getLogger(check_settings.__module__)
    propagate, settings_log.propagate = settings_log.propagate, False
    settings_log.addHandler(said)
    try:
        check_settings()
    except SettingsError as err:
        print(f"error: {one_line(err)}", file=sys.stderr)
        return False
    finally:
        settings_log.removeHandler(said)
        settings_log.propagate = propagate
    return True


def _said_for_command(err: BaseException, args: argparse.Namespace) -> BaseException:
    """A disk bound's refusal that only the sources this command read before fill (it holds them until it ends: a
    mix's inputs, an adapter beside its ``--base-config``), with the advice that fits the command, as fetch says it."""
    if not isinstance(err, DiskCacheFullError):
        return err
    from vllm_lora_ext.cli._args import held_sources, said_beside_own

    base = err.source == getattr(args, "base_config", None)  # (a base model's config.json, under the same bound)
    fewer = "give --base-config the model's config.json as a local file" if base else getattr(args, "fewer", None)
    return said_beside_own(err, held_sources(), done="read", fewer=fewer)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI and return its exit code."""
    parser = _parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    args, extra = parser.parse_known_args(argv)
    if extra:  # with the usage of the command it follows: the top level's before the command's name
        before = args.command in argv and extra[0] in argv and argv.index(extra[0]) < argv.index(args.command)
        (parser if before else getattr(args, "_parser", parser)).error(f"unrecognized arguments: {' '.join(extra)}")
    if not _settings_checked(args.quiet):
        return 1
    with _logging(args.verbose, args.quiet, bars=not (args.quiet or getattr(args, "json", False))):
        try:
            with strict_warnings():
                code = int(args.func(args))
            sys.stdout.flush()
            return code
        except BrokenPipeError:  # `vllm-lora inspect X | head`: the reader has what it wanted
            _quiet_stdout()
            return 0
        except KeyboardInterrupt:
            print("error: interrupted", file=sys.stderr)
            return 130
        except (VllmLoraExtError, OSError) as err:
            if args.verbose > 1:
                traceback.print_exc()
            print(f"error: {one_line(_said_for_command(err, args))}", file=sys.stderr)
            return 1
        except Warning as err:
            if args.verbose > 1:
                traceback.print_exc()
            print(f"error: {type(err).__name__} (a warning, refused so that nothing wrong is written): {one_line(err)}",
                  file=sys.stderr)
            return 1
        except Exception as err:  # never a bare traceback: name the failure, keep the traceback for -vv
            if args.verbose > 1:
                traceback.print_exc()
            print(f"error: unexpected {type(err).__name__}: {one_line(err)} (run with -vv for details)",
                  file=sys.stderr)
            return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
