"""The plugin's patch registry: every change it makes to vLLM, recorded so that ``uninstall()`` undoes all of it.

Two kinds, each with its reason:

- **out-of-tree replacements** (:func:`register_oot`) — the way vLLM 0.32 offers: ``base.register_oot`` of a
  subclass of a ``CustomOp`` / ``PluggableLayer`` with our methods, so every ``base(...)`` vLLM builds afterwards
  is that subclass (their ``__new__`` looks the exact class name up in ``op_registry_oot``);
- **class patches** (:func:`patch`) — only for what offers no such hook; each call states why.

Every concern module (``layers``, ``decoders``, ``tp``, ``moe``, ``sampler``, ``config``, ``attention``, ``plugin``) registers
its own through this module, which imports none of them (so the package has no import cycle), and hooks call
vLLM's original through :func:`original`.
"""

from __future__ import annotations

MISSING = object()

# (class, attribute) -> (what the class's own __dict__ held, or MISSING when inherited; the attribute as looked up)
_originals: dict = {}
_reasons: dict = {}         # class -> why it is class-patched (it offers no out-of-tree hook)
_oot: dict = {}             # vLLM base-class name -> our registered subclass
_restores: dict = {}        # key -> a function that undoes a registration that is neither of the above


def patch(cls, name: str, new, reason: str) -> None:
    """Set ``cls.<name> = new`` (a class vLLM offers no out-of-tree hook for; ``reason`` says why)."""
    key = (cls, name)
    if key not in _originals:
        _originals[key] = (cls.__dict__.get(name, MISSING), getattr(cls, name, None))
    _reasons.setdefault(cls, reason)
    setattr(cls, name, new)


def original(cls, name: str):
    """vLLM's own ``cls.<name>`` as it was before :func:`patch` (the function itself, to call with ``self``)."""
    return _originals[(cls, name)][1]


def patched_classes() -> dict:
    """``{class name: class}`` of every class-patched vLLM class (none offers an out-of-tree hook)."""
    return {cls.__name__: cls for cls in _reasons}


def class_patch_reasons() -> dict:
    """``{class name: why it is a class patch}``."""
    return {cls.__name__: why for cls, why in _reasons.items()}


def register_oot(base, on_init=None, **methods) -> type:
    """Hook a vLLM ``CustomOp`` or ``PluggableLayer`` the way vLLM offers (module docstring); ``on_init(self)``
    runs after vLLM's own ``__init__`` (the plugin records the model's architecture and profile there);
    ``_aligned_base`` on the subclass is vLLM's class. A ``forward`` is overridden (not ``forward_cpu``): the op
    must run whatever vLLM's custom-op enablement says. Idempotent."""
    from vllm.model_executor.custom_op import op_registry_oot

    if base.__name__ in _oot:
        return _oot[base.__name__]
    if base.__name__ in op_registry_oot:
        raise RuntimeError(f"aligned_ops vLLM plugin: {base.__name__} already has an out-of-tree replacement "
                           f"({op_registry_oot[base.__name__]}); two plugins cannot both own it")

    def __init__(self, *args, **kwargs):
        base.__init__(self, *args, **kwargs)
        if on_init is not None:
            on_init(self)

    body = {"__init__": __init__, "_aligned_base": base, "__module__": __name__, **methods}
    hooked = type(f"Aligned{base.__name__}", (base,), body)
    base.register_oot(hooked)
    _oot[base.__name__] = hooked
    return hooked


def oot_registered() -> dict:
    """``{vLLM base-class name: our subclass}`` of every out-of-tree replacement registered."""
    return dict(_oot)


def on_restore(key: str, undo) -> None:
    """Remember how to undo a registration of another kind (the attention backend's registry slot); the first
    call for ``key`` wins (it saw vLLM's state)."""
    _restores.setdefault(key, undo)


def restore_all() -> None:
    """Undo every patch, out-of-tree registration and recorded registration (engines already built keep their
    aligned layers)."""
    from vllm.model_executor.custom_op import op_registry_oot

    for name in list(_oot):
        op_registry_oot.pop(name, None)
        del _oot[name]
    for (cls, name), (own, _) in list(_originals.items()):
        if own is MISSING:
            if name in cls.__dict__:
                delattr(cls, name)
        else:
            setattr(cls, name, own)
        del _originals[(cls, name)]
    _reasons.clear()
    for key, undo in list(_restores.items()):
        undo()
        del _restores[key]
