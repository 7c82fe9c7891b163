"""The one wrapper helper every patch uses, and the mark it leaves.

``_wrap(original, wrapper, part)`` makes ``wrapper`` look like ``original``
(name, qualname, doc, ``__wrapped__``) and marks it with the part that made
it, so a part can tell whether it already wrapped a function, even under
another part's wrapper: ``wrapped_by(function, part)`` walks the chain.
"""

_MARK = "__mlx_hotfix_wrapped__"


def _wrap(function, wrapper, part=True):
    # functools here, not at the top: patches wrap only after mlx_lm is
    # imported, and the drop-in imports only os and sys before that.
    from functools import update_wrapper

    # __module__ and __dict__ stay the wrapper's own (a function's __dict__
    # would bring the mark of the part that wrapped it before).
    update_wrapper(wrapper, function, assigned=("__name__", "__qualname__", "__doc__"),
                   updated=())
    setattr(wrapper, _MARK, part)
    return wrapper


def wrapped_by(function, part):
    """True if `part` wrapped function, anywhere along its __wrapped__ chain."""
    seen = 0
    while function is not None and seen < 50:
        if getattr(function, _MARK, None) == part:
            return True
        function = getattr(function, "__wrapped__", None)
        seen += 1
    return False
