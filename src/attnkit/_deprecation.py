"""Old spellings of renamed public names: each keeps working and warns with the new spelling.

``renamed_kwargs(old="new")`` decorates a function or ``__init__`` whose keyword was renamed;
``renamed_property("new")`` is a read-only attribute that forwards to its new name. Every room
uses these two, so a deprecation reads and warns the same everywhere."""

from __future__ import annotations

import functools
import warnings


def renamed_kwargs(**renames: str):
    """Decorate a function so that each old keyword name in ``renames`` (old="new") still works,
    with a DeprecationWarning naming the new spelling; giving both is a TypeError."""
    def wrap(fn):
        owner = fn.__qualname__.replace(".__init__", "")

        @functools.wraps(fn)
        def inner(*args, **kwargs):
            for old, new in renames.items():
                if old in kwargs:
                    if new in kwargs:
                        raise TypeError(f"{owner}() got both {new}= and {old}= (its deprecated name); pass {new}=")
                    warnings.warn(f"{owner}({old}=...) is deprecated; pass {new}=...", DeprecationWarning,
                                  stacklevel=2)
                    kwargs[new] = kwargs.pop(old)
            return fn(*args, **kwargs)
        return inner
    return wrap


class renamed_property:
    """A class attribute ``old = renamed_property("new")``: reading ``obj.old`` warns and returns
    ``obj.new``."""

    def __init__(self, new: str):
        self.new = new
        self.old = new

    def __set_name__(self, owner, name: str) -> None:
        self.old = name
        self.__doc__ = f"Deprecated name of :attr:`{self.new}`."

    def __get__(self, obj, owner=None):
        if obj is None:
            return self
        warnings.warn(f"{type(obj).__name__}.{self.old} is deprecated; read .{self.new}", DeprecationWarning,
                      stacklevel=2)
        return getattr(obj, self.new)
