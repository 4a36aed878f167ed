"""One way to patch vLLM: checked, marked, recorded, and undoable.

Every patch the plugin applies is a [`Patch`] in ``plugin.PATCHES``: the module and attribute it
replaces, the parameters the original must have (so a vLLM release that changes the signature
makes ``register()`` refuse, naming the piece, instead of patching blindly), why the patch exists,
and the upstream change that would let us delete it. `apply_patch` checks all that, marks the
replacement (``__vllm_lora_ext_patched__``, ``__wrapped__``) and records the original so that
`undo_all` restores it.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import inspect
import logging
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from vllm_lora_ext.errors import UnsupportedVLLMError

logger = logging.getLogger(__name__)

PATCH_MARK = "__vllm_lora_ext_patched__"
IDENTITY_ATTR = "vllm_lora_ext_identity"  # the pinned lora_path a worker's LoRAModel was built from
STAGED_ATTR = "_vllm_lora_ext_staged"  # on a LoRAModel whose tensors are still on a GPU staging buffer (staging.py)


@dataclass(frozen=True)
class Patch:
    """One replacement of a vLLM attribute.

    Attributes:
        module: the module that holds the class or function (patched right after vLLM imports it).
        target: ``Class.method``, or ``function`` for a name in the module itself.
        params: the original's parameter names (after ``self`` for a method) the replacement relies on.
        make: ``make(original) -> replacement``.
        why: what would go wrong without it.
        delete_when: the upstream change that makes it unnecessary.
    """

    module: str
    target: str
    params: Sequence[str]
    make: Callable[[Callable[..., Any]], Callable[..., Any]]
    why: str
    delete_when: str

    @property
    def name(self) -> str:
        return f"{self.module}.{self.target}"


_APPLIED: dict[str, tuple[Any, str, Any]] = {}  # patch name -> (owner class, attribute, original)


def check_target(module: ModuleType, patch: Patch) -> tuple[Any, str, Any]:
    """Return ``(owner, attribute, original)`` after checking that the target exists with the expected parameters.

    Raises:
        [`UnsupportedVLLMError`]: the class, the attribute, or one of its expected parameters is missing.
    """
    cls_name, dot, attr = patch.target.partition(".")
    owner: Any = getattr(module, cls_name, None) if dot else module
    attr = attr if dot else cls_name
    original = getattr(owner, attr, None) if owner is not None else None
    if original is None:
        raise UnsupportedVLLMError(
            f"vllm_lora_ext cannot patch {patch.name}: it does not exist in this vLLM. This vLLM release is not "
            f"supported yet; install a supported one or set VLLM_LORA_EXT_DISABLE=1.")
    if getattr(original, PATCH_MARK, False):
        original = original.__wrapped__
    try:
        have = [p for p in inspect.signature(original).parameters][1 if dot else 0:]
    except (TypeError, ValueError):
        have = []
    missing = [p for p in patch.params if p not in have]
    if missing:
        raise UnsupportedVLLMError(
            f"vllm_lora_ext cannot patch {patch.name}: its parameters are {have}, without {missing}. This vLLM "
            f"release changed it; install a supported one or set VLLM_LORA_EXT_DISABLE=1.")
    return owner, attr, original


def apply_patch(module: ModuleType, patch: Patch) -> None:
    """Apply ``patch`` to ``module`` once (a second call changes nothing)."""
    owner, attr, original = check_target(module, patch)
    if getattr(getattr(owner, attr), PATCH_MARK, False):
        return
    replacement = patch.make(original)
    setattr(replacement, PATCH_MARK, patch.name)
    setattr(replacement, "__wrapped__", original)
    setattr(owner, attr, replacement)
    _APPLIED[patch.name] = (owner, attr, original)
    logger.debug("patched %s", patch.name)


def applied() -> list[str]:
    """Return the names of the patches in place, in the order they were applied."""
    return list(_APPLIED)


def undo_all() -> None:
    """Restore every patched attribute to vLLM's original."""
    for name, (owner, attr, original) in reversed(list(_APPLIED.items())):
        setattr(owner, attr, original)
        logger.debug("restored %s", name)
    _APPLIED.clear()


# ---------------------------------------------------------------- post-import hooks: patch a module when it loads

class _PostImportLoader(importlib.abc.Loader):
    def __init__(self, inner: importlib.abc.Loader, callbacks: list[Callable[[ModuleType], None]]) -> None:
        self._inner = inner
        self._callbacks = callbacks

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._inner.exec_module(module)
        for cb in self._callbacks:
            cb(module)

    def __getattr__(self, name: str) -> Any:  # get_source, get_filename, ... for tracebacks
        return getattr(self._inner, name)


class _PostImportFinder(importlib.abc.MetaPathFinder):
    """Runs callbacks right after a named module is executed, without importing it early."""

    def __init__(self) -> None:
        self.hooks: dict[str, list[Callable[[ModuleType], None]]] = {}
        self._busy = threading.local()

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname not in self.hooks or getattr(self._busy, "name", None) == fullname:
            return None
        self._busy.name = fullname
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            self._busy.name = None
        if spec is None or spec.loader is None:
            return None
        spec.loader = _PostImportLoader(spec.loader, self.hooks[fullname])
        return spec


_FINDER: _PostImportFinder | None = None


def cancel_hooks() -> None:
    """Drop every post-import callback not yet run (``unregister()``)."""
    if _FINDER is not None:
        _FINDER.hooks.clear()


def when_imported(module_name: str, callback: Callable[[ModuleType], None]) -> None:
    """Run ``callback(module)`` now if ``module_name`` is imported, else right after it is."""
    global _FINDER
    mod = sys.modules.get(module_name)
    if mod is not None:
        callback(mod)
        return
    if _FINDER is None:
        _FINDER = _PostImportFinder()
        sys.meta_path.insert(0, _FINDER)
    _FINDER.hooks.setdefault(module_name, []).append(callback)

