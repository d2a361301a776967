"""Test-time speed-up of Triton's interpreter (TRITON_INTERPRET=1), semantics unchanged.

The interpreter re-patches triton.language (inspect.getmembers over tl, tl.tensor, tl.math, ...)
on every call of a @triton.jit device function, not only once per launch. Inside a launch the
language is already patched, so each of those re-patches only rewrites the same attributes again:
for kernels that call helpers inside their loops (the paged and decode kernels) it was about a
quarter of the suite's CPU time, a third of the paged kernels' tests. Here a device-function call
whose language modules are already patched in the running launch skips the re-patch; a launch,
or the first helper that sees a module not patched yet, goes through Triton's own code as before.

install() is a no-op when the interpreter lacks the functions this relies on (another Triton
version), so tests then run at Triton's own speed rather than fail.
"""

from __future__ import annotations

import inspect

# Triton's own (_patch_lang, GridExecutor.__call__), once install() has replaced them.
originals: tuple = ()
# Inside a launch: [None] until the launch has patched the language, then [the language modules
# patched so far].
_launch: list = []


class _Nothing:
    def restore(self) -> None:
        pass


def wrap(original_patch, original_call):
    """(_patch_lang, GridExecutor.__call__) that patch the language once per launch, in front of
    Triton's `original_patch` and `original_call`."""
    import triton.language as tl

    langs_by_globals: dict[int, frozenset] = {}

    def langs_of(fn) -> frozenset:
        # the same test as Triton's _patch_lang for which language modules a function sees, once per
        # module namespace (a module's imports do not change while its kernels run)
        key = id(fn.__globals__)
        if key not in langs_by_globals:
            langs_by_globals[key] = frozenset(
                id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core))
        return langs_by_globals[key]

    def patch_lang(fn):
        if not _launch:
            return original_patch(fn)  # outside a launch: Triton's own behaviour
        langs = langs_of(fn)
        if _launch[0] is None:  # the launch's own patch (GridExecutor.__call__ restores it)
            scope = original_patch(fn)
            _launch[0] = langs
            return scope
        if langs <= _launch[0]:
            return _Nothing()  # a helper whose modules are patched already
        # A helper that sees a module not patched yet (tl.sum & co. see triton.language.core, where
        # a kernel's module sees triton.language): Triton patches it, and never restores that
        # patch, so the module stays patched for the rest of the launch (and after it).
        scope = original_patch(fn)
        _launch[0] = _launch[0] | langs
        return scope

    def call(self, *args, **kwargs):
        _launch[:] = [None]
        try:
            return original_call(self, *args, **kwargs)
        finally:
            _launch.clear()

    patch_lang._minipaged_once = True
    return patch_lang, call


def install() -> bool:
    """Put wrap()'s functions in place of Triton's; False (and nothing changed) where this Triton
    lacks them or they are wrapped already."""
    global originals
    try:
        from triton.runtime import interpreter
    except ImportError:
        return False
    original = getattr(interpreter, "_patch_lang", None)
    executor = getattr(interpreter, "GridExecutor", None)
    if original is None or executor is None or getattr(original, "_minipaged_once", False):
        return False
    if getattr(original, "__module__", None) != interpreter.__name__:
        return False  # someone else's wrapper: leave it alone
    originals = (original, executor.__call__)
    interpreter._patch_lang, executor.__call__ = wrap(*originals)
    return True
