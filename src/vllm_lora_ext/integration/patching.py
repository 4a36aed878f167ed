"""One way to patch vLLM: checked, marked, recorded, and undoable.

Every patch the plugin applies is a [`Patch`] in ``plugin.PATCHES``: the module and attribute it
replaces, the process it runs in, the parameters the original must have and the vLLM private
attributes the replacement reads (so a vLLM release that changes either makes ``register()`` refuse,
naming the piece, instead of patching blindly), the attributes it writes onto vLLM objects, why the
patch exists, and the upstream change that would let us delete it. `apply_patch` checks all that,
marks the replacement (``__vllm_lora_ext_patched__``, ``__wrapped__``) and records the original so
that `undo_all` restores it.

The attributes the plugin sets on vLLM objects are named here, once (the ``*_ATTR`` constants).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import dis
import functools
import inspect
import logging
import sys
import threading
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Literal

from vllm_lora_ext.errors import UnsupportedVLLMError

logger = logging.getLogger(__name__)

PATCH_MARK = "__vllm_lora_ext_patched__"
IDENTITY_ATTR = "vllm_lora_ext_identity"  # the pinned lora_path a worker's LoRAModel was built from
STAGED_ATTR = "_vllm_lora_ext_staged"  # on a LoRAModel whose tensors are still on a GPU staging buffer (staging.py)
MERGED_ATTR = "_vllm_lora_ext_merged"  # on a LoRAModel vLLM's merge ran on off the engine thread (prebuild.py)
PART_OWNERS_ATTR = "_vllm_lora_ext_part_owners"  # on a LoRAModelManager: packed part -> its module (worker_patches.py)
UNSCANNED_ATTR = "_vllm_lora_ext_unscanned"  # on a LoRAModel whose MoE factors await their NaN/inf scan (prebuild.py)
# on a LoRAModel whose fused 3D B factors still lie as stored: [(tensor, rows, cols, scale)] (staging.stage turns them)
UNTURNED_ATTR = "_vllm_lora_ext_unturned"
ACTIVATION_ATTR = "_vllm_lora_ext_activation"  # on a staged LoRAModel: its recorded slot writes (activation.py)
PREBUILD_ATTR = "_vllm_lora_ext_prebuild"  # on a WorkerLoRAManager: its table of background builds (prebuild.py)
PREBUILD_NAMES_ATTR = "_vllm_lora_ext_prebuild_names"  # on a WorkerLoRAManager: pinned source -> probe's name
RESIDENT_NAMES_ATTR = "_vllm_lora_ext_resident_names"  # on a WorkerLoRAManager: lora_int_id -> registered name
TRAITS_ATTR = "_vllm_lora_ext_traits"  # on a LoRAModelManager: the model traits that decide unapplied keys (loader.py)
OFFLINE_LOADED_ATTR = "_vllm_lora_ext_loaded"  # on an LLMEngine: {lora_int_id: pinned path} preloaded offline
ROUTED_ATTR = "_vllm_lora_ext_lora_request"  # on a request object: the LoRARequest its routing chose (server.py)
DEPLOYMENT_ATTR = "vllm_lora_ext_deployment"  # on OpenAIServingModels: the deployment config (server.py)
DISK_HOLDS_ATTR = "vllm_lora_ext_disk_holds"  # on OpenAIServingModels: the disk-cache holds of its adapters
PINNED_NAMES_ATTR = "vllm_lora_ext_pinned_names"  # on OpenAIServingModels: adapters registered at start-up
SLOT_RANKS_ATTR = "_vllm_lora_ext_slot_ranks"  # on a PunicaWrapperGPU: each slot's live rank (slot_ranks.py)
LIVE_RANK_ATTR = "_vllm_lora_ext_live_rank"  # on a LoRAModel: the largest rank of its factors (slot_ranks.py)

Process = Literal["server", "engine", "worker"]
PROCESSES: tuple[Process, ...] = ("server", "engine", "worker")


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
        process: the vLLM process the target runs in: ``server`` (the API server's serving objects),
            ``engine`` (an engine client: ``LLMEngine`` offline, ``AsyncLLM`` in the API server) or
            ``worker`` (the process that owns a GPU and its LoRA manager); ``worker`` unless named.
        reads: the vLLM private attributes the replacement reads on the patched object, as a path from
            ``self`` (``_adapter_manager._registered_adapters``). The first name is checked on the class
            by `apply_patch` (a class attribute, or one a method of the class assigns to ``self``); the
            rest live on other objects, created at run time, so they are checked on the first call.
        writes: the attributes the replacement sets on vLLM objects, as ``Class.attribute``.
        related: the upstream vLLM PR or issue about it, if one is named.
    """

    module: str
    target: str
    params: Sequence[str]
    make: Callable[[Callable[..., Any]], Callable[..., Any]]
    why: str
    delete_when: str
    process: Process = "worker"
    reads: Sequence[str] = ()
    writes: Sequence[str] = ()
    related: str = ""

    def __post_init__(self) -> None:
        if self.process not in PROCESSES:
            raise ValueError(f"Patch {self.name}: process {self.process!r} is not one of {PROCESSES}.")
        if self.reads and "." not in self.target:
            raise ValueError(f"Patch {self.name}: a module-level function has no 'self' to read {self.reads} on.")

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
    absent = [name for name in patch.reads if not class_has(owner, name.partition(".")[0])]
    if absent:
        raise UnsupportedVLLMError(
            f"vllm_lora_ext cannot patch {patch.name}: it reads {absent}, which {owner.__name__} neither defines nor "
            f"sets in this vLLM. This vLLM release changed it; install a supported one or set VLLM_LORA_EXT_DISABLE=1.")
    return owner, attr, original


def class_has(cls: Any, name: str) -> bool:
    """Whether ``cls`` has attribute ``name``, or a method of a class in its MRO stores an attribute ``name``
    (``self.<name> = ...``: an attribute that exists only on instances), read from the methods' bytecode."""
    if hasattr(cls, name):
        return True
    for klass in getattr(cls, "__mro__", (cls,)):
        for value in vars(klass).values():
            if isinstance(value, (staticmethod, classmethod)):
                value = value.__func__
            functions = (value.fget, value.fset) if isinstance(value, property) else (value,)
            codes = [inspect.unwrap(f).__code__ for f in functions if hasattr(inspect.unwrap(f), "__code__")]
            if any(_stores(code, name) for code in codes):
                return True
    return False


def _stores(code: types.CodeType, name: str) -> bool:
    if name not in code.co_names and not any(isinstance(c, types.CodeType) for c in code.co_consts):
        return False
    if any(ins.opname == "STORE_ATTR" and ins.argval == name for ins in dis.get_instructions(code)):
        return True
    return any(_stores(c, name) for c in code.co_consts if isinstance(c, types.CodeType))


def missing_reads(obj: Any, patch: Patch) -> list[str]:
    """Return the attributes of ``patch.reads`` that ``obj`` (an instance of the patched class) lacks."""
    missing = []
    for path in patch.reads:
        value = obj
        for part in path.split("."):
            if not hasattr(value, part):
                missing.append(path)
                break
            value = getattr(value, part)
    return missing


def _checked_on_first_call(replacement: Callable[..., Any], patch: Patch) -> Callable[..., Any]:
    """Wrap ``replacement`` so that its first call checks ``patch.reads`` on the instance (the attributes beyond the
    class's own, which exist only at run time) and logs one error naming any that are missing; the replacement
    then runs as it does whenever one is absent (it falls back to vLLM's own path)."""
    checked = threading.Event()

    @functools.wraps(replacement)
    def first_call_checked(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not checked.is_set():
            checked.set()
            missing = missing_reads(self, patch)
            if missing:
                logger.error("vllm_lora_ext: %s reads %s, which this vLLM's %s lacks; that part of the patch falls "
                             "back to vLLM's own path. Install a supported vLLM or set VLLM_LORA_EXT_DISABLE=1.",
                             patch.name, missing, type(self).__name__)
        return replacement(self, *args, **kwargs)

    return first_call_checked


def apply_patch(module: ModuleType, patch: Patch) -> None:
    """Apply ``patch`` to ``module`` once (a second call changes nothing)."""
    owner, attr, original = check_target(module, patch)
    if getattr(getattr(owner, attr), PATCH_MARK, False):
        return
    replacement = patch.make(original)
    if any("." in path for path in patch.reads):
        replacement = _checked_on_first_call(replacement, patch)
    setattr(replacement, PATCH_MARK, patch.name)
    setattr(replacement, "__wrapped__", original)
    setattr(owner, attr, replacement)
    _APPLIED[patch.name] = (owner, attr, original)
    logger.debug("patched %s", patch.name)


def applied() -> list[str]:
    """Return the names of the patches in place, in the order they were applied."""
    return list(_APPLIED)


def undo(name: str) -> None:
    """Restore the one patched attribute ``name`` (a [`Patch`]'s name) to vLLM's original, if it is patched."""
    found = _APPLIED.pop(name, None)
    if found is not None:
        owner, attr, original = found
        setattr(owner, attr, original)


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

