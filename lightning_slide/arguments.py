"""Config values checked against the signature of the class they are passed to, before it is called.

A wrong value handed straight to a library fails somewhere inside it, in its words (`'<' not supported
between instances of 'str' and 'int'`); checked against the type annotations first, it is named as the user
wrote it: `trainer.max_steps='abc' must be an int (e.g. trainer.max_steps=100)`.
"""

from __future__ import annotations

import inspect
import json
import types
import typing
from collections.abc import Callable, Mapping
from difflib import get_close_matches


def check_arguments(function: Callable, settings: Mapping[str, object], prefix: str, owner: str) -> None:
    """ValueError naming every setting that `function` has no argument for, or whose value its annotation
    rules out; `prefix` is the settings' config group (`trainer`), `owner` what takes them (`lightning.Trainer`)."""
    signature = inspect.signature(function)
    try:
        hints = typing.get_type_hints(function)
    except (NameError, TypeError):  # an annotation that does not resolve: names are still checked
        hints = {}
    problems = []
    for name, value in settings.items():
        if name not in signature.parameters:
            close = get_close_matches(name, signature.parameters, n=1)
            problems.append(f"{prefix}.{name} is not an argument of {owner}"
                            + (f" (did you mean {prefix}.{close[0]}?)" if close else ""))
        elif name in hints and not conforms(value, hints[name]):
            sample = example(hints[name], signature.parameters[name].default)
            problems.append(f"{prefix}.{name}={value!r} must be {describe(hints[name])}"
                            + (f" (e.g. {prefix}.{name}={sample})" if sample is not None else ""))
    if problems:
        raise ValueError("; ".join(problems) + ".")


def _alternatives(annotation: object) -> tuple:
    union = typing.get_origin(annotation) in (typing.Union, types.UnionType)
    return typing.get_args(annotation) if union else (annotation,)


def conforms(value: object, annotation: object) -> bool:
    """Whether a config value fits an annotation: None, int, float (an int too), bool, str, Literal, Union,
    list/dict/Iterable of these, and classes; a form not known here is left to the callee to judge."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return any(conforms(value, a) for a in _alternatives(annotation))
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if annotation is None or annotation is type(None):
        return value is None
    if origin is typing.Literal:
        return any(value == a and type(value) is type(a) for a in args)
    if annotation in (int, float) and isinstance(value, bool):  # YAML's true is no number
        return False
    if annotation is float:
        return isinstance(value, (int, float))
    if isinstance(origin, type):
        if not isinstance(value, origin):
            return False
        if isinstance(value, Mapping):
            return not args or all(conforms(k, args[0]) and conforms(v, args[1]) for k, v in value.items())
        return not args or all(conforms(item, args[0]) for item in value)
    return isinstance(value, annotation) if isinstance(annotation, type) else True


def describe(annotation: object) -> str:
    """An annotation in words: `Optional[int]` is "an int or null"; Literal choices are listed together."""
    alternatives = _alternatives(annotation)
    choices = [v for a in alternatives if typing.get_origin(a) is typing.Literal for v in typing.get_args(a)]
    words = ["one of " + ", ".join(map(repr, choices))] if choices else []
    kinds = [a for a in alternatives if typing.get_origin(a) is not typing.Literal
             and not (a is int and float in alternatives)]  # "a number" covers the ints
    words += [_describe_one(a) for a in kinds]
    return " or ".join(dict.fromkeys(words))


def _describe_one(annotation: object) -> str:
    names = {int: "an int", float: "a number", bool: "true or false", str: "a string", type(None): "null"}
    if annotation in names or annotation is None:
        return names[annotation or type(None)]
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if isinstance(origin, type):
        members = ", ".join(getattr(a, "__name__", str(a)) for a in args)
        return f"a {origin.__name__}" + (f" of {members}" if args else "")
    return f"a {getattr(annotation, '__name__', annotation)}"


def example(annotation: object, default: object) -> str | None:
    """A value of the annotated type as it is written on the command line: the default where it is one
    (and not the -1 that means "unset"), else a plain value of the first type; None where the annotation
    lists its choices (the message has them already)."""
    if default is not None and default != -1 and default is not inspect.Parameter.empty \
            and conforms(default, annotation):
        return default if isinstance(default, str) else json.dumps(default)
    if any(typing.get_origin(a) is typing.Literal for a in _alternatives(annotation)):
        return None
    first = next(a for a in _alternatives(annotation) if a is not type(None))
    return {int: "100", float: "0.5", bool: "true", str: "..."}.get(first, "...")
