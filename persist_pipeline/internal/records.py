"""Faster construction of frozen slotted dataclasses on the commit path.

A frozen dataclass's generated ``__init__`` sets each field with
``object.__setattr__(self, name, value)``, which costs a generic attribute lookup per
field. :func:`quick_init` gives such a class an ``__init__`` with the same signature that
sets each slot through the slot's own descriptor instead: the instance is as immutable
as before (assignment still raises ``FrozenInstanceError``), it is only made faster.
"""

from __future__ import annotations

from dataclasses import MISSING, fields, is_dataclass
from typing import Any, TypeVar

T = TypeVar("T")


def quick_init(cls: type[T]) -> type[T]:
    """Replace the ``__init__`` of ``cls`` (a frozen, slotted dataclass whose fields all
    take plain defaults, without ``__post_init__``) by one that fills its slots
    directly. Apply it above ``@dataclass``. A field with ``init=False`` (and a plain
    default) is set to its default, as the generated ``__init__`` does.

    Raises:
        TypeError: ``cls`` is not such a dataclass.
    """
    params = getattr(cls, "__dataclass_params__", None)
    if not is_dataclass(cls) or params is None or not params.frozen \
            or "__slots__" not in cls.__dict__ or hasattr(cls, "__post_init__"):
        raise TypeError(f"quick_init needs a frozen, slotted dataclass without "
                        f"__post_init__, got {cls!r}")
    env: dict[str, Any] = {}
    args: list[str] = []
    body: list[str] = []
    for f in fields(cls):
        if f.kw_only or f.default_factory is not MISSING or (not f.init
                                                              and f.default is MISSING):
            raise TypeError(f"quick_init: field {f.name} of {cls.__name__} is not a plain "
                            f"positional field")
        if not f.init:
            env[f"_default_{f.name}"] = f.default
            env[f"_set_{f.name}"] = cls.__dict__[f.name].__set__
            body.append(f"    _set_{f.name}(self, _default_{f.name})")
            continue
        if f.default is MISSING:
            args.append(f.name)
        else:
            env[f"_default_{f.name}"] = f.default
            args.append(f"{f.name}=_default_{f.name}")
        env[f"_set_{f.name}"] = cls.__dict__[f.name].__set__
        body.append(f"    _set_{f.name}(self, {f.name})")
    source = f"def __init__(self, {', '.join(args)}):\n" + ("\n".join(body) or "    pass")
    exec(source, env)  # noqa: S102 - built here from the class's own field names
    init = env["__init__"]
    init.__qualname__ = f"{cls.__qualname__}.__init__"
    init.__module__ = cls.__module__
    init.__doc__ = cls.__init__.__doc__
    setattr(cls, "__init__", init)  # noqa: B010 - replacing a method on purpose
    return cls
