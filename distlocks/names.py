"""Lock names formed from a call's arguments: the check, made once when the caller is defined.

``LockedTask.lock_name`` and the ``distributed_lock`` view decorator both take a
format string over their function's arguments; this module says, before any
call, whether every placeholder of one names an argument. It imports nothing of
distlocks, so both can use it.
"""

from __future__ import annotations

import inspect
import string
from collections.abc import Mapping


def check_name_fields(pattern: str, parameters: Mapping[str, inspect.Parameter], label: str, of: str) -> None:
    """Raise ValueError unless every placeholder of ``pattern`` names one of ``parameters``.

    A ``**kwargs`` among ``parameters`` takes any name. ``label`` names the
    option in the message (``"lock_name"``), ``of`` whose arguments they are
    (``"the task"``). ``{item.attr}`` and ``{item[0]}`` count as ``{item}``;
    a positional ``{0}`` or ``{}`` is refused.
    """
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
    try:
        fields = [field for _, field, _, _ in string.Formatter().parse(pattern) if field is not None]
    except ValueError as exc:
        raise ValueError(f"{label} {pattern!r} is not a valid format string: {exc}") from exc
    for field in fields:
        argument = field.split(".", 1)[0].split("[", 1)[0]
        if not argument or argument.isdigit():
            raise ValueError(f"{label} {pattern!r} must name arguments: {{{field}}} is positional")
        if argument not in parameters and not takes_any:
            known = ", ".join(parameters) or "none"
            raise ValueError(
                f"{label} {pattern!r} refers to {{{argument}}}, which is not an argument of {of} (arguments: {known})"
            )
