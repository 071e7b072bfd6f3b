"""Chat templates rendered within a budget, and their failures as one line naming the template.

A chat template is a program that comes with the model (``chat_template.jinja``, or ``chat_template`` in
``tokenizer_config.json``), often from the Hub. transformers renders it in jinja2's sandbox, which keeps
it away from Python's internals but not from memory or time: three nested ``range(100000)`` loops, or
``'x' * 100000000`` multiplied again, run for minutes and take gigabytes. Here the same rendering
(transformers' ``apply_chat_template``, its environment, filters and globals) runs in a subclass of that
sandbox with a budget:

* work: every loop iteration (plus the template text its body writes), call, filter, operator, slice,
  comparison operand and piece of output is charged the characters (or items) it reads and makes; a
  render may spend ``WORK`` in all;
* size: no single value may grow past ``CHARACTERS``, and the operations that make much more than they
  read (repetition, padding to a width, ``replace``, ``join``, ``indent``, ``format`` widths, powers) are
  refused before they allocate.

A legitimate template spends a few times its output (MiniCPM4.1's about 5 units a character), so the
size limit binds long before the budget on any real conversation, while a hostile template stops within
a second and a few hundred megabytes. Deep macro recursion ends in Python's RecursionError, reported the
same way. docs/runtime.md has the measurements.
"""
from __future__ import annotations

import functools
import re
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path
from typing import Any, Callable

from jinja2 import TemplateError, nodes
from jinja2.environment import Template
from jinja2.exceptions import SecurityError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from quantkit.errors import QuantkitError

CHARACTERS = 4_000_000  # the largest value or output: a prompt far beyond any context (4 chars a token)
WORK = 100_000_000  # characters or items read and made by one render, in all
STEPS = 1_000_000  # loop iterations, calls, filters and operators of one render

TEMPLATE_FILE = "chat_template.jinja"
TOKENIZER_CONFIG = "tokenizer_config.json"


class ChatTemplateError(QuantkitError, ValueError):
    """A chat template that fails, is refused by the sandbox, or exceeds its budget."""


class TemplateFailed(TemplateError):
    """A template stopped by a Python error of any kind (a TypeError of its own making, a RecursionError)."""


def template_source(tokenizer) -> str:
    """Where the tokenizer's chat template came from, as transformers reads it: the template file beside the
    tokenizer, else the tokenizer config."""
    directory = Path(getattr(tokenizer, "name_or_path", "") or ".")
    name = TEMPLATE_FILE if (directory / TEMPLATE_FILE).is_file() else TOKENIZER_CONFIG
    return str(directory / name)


def render_chat(tokenizer, messages: list[dict], tokenize: bool = True, **template_kwargs) -> list[int] | str:
    """``tokenizer.apply_chat_template(messages, **template_kwargs)`` as token ids (as text if not
    ``tokenize``), rendered within the budget; any failure of the template is one ``ChatTemplateError``
    line naming its source. Every chat template quantkit renders goes through here."""
    from transformers.utils import chat_template_utils

    try:
        with _substituted(chat_template_utils, "_compile_jinja_template", _compile):
            return tokenizer.apply_chat_template(messages, tokenize=tokenize, return_dict=False, **template_kwargs)
    except (TemplateError, RecursionError) as e:
        raise ChatTemplateError(f"chat template {template_source(tokenizer)}: {_one_line(e)}") from None


def _one_line(error: BaseException) -> str:
    cause = error.__cause__ if isinstance(error, TemplateFailed) and error.__cause__ is not None else error
    text = " ".join(str(cause).split()) or "(no message)"
    text = text if len(text) <= 300 else text[:297] + "..."
    return f"{type(cause).__name__}: {text}"


@contextmanager
def _substituted(module, name: str, value):
    """``module.name`` is ``value`` for the duration: transformers' rendering looks its environment up there."""
    original = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, original)


@functools.lru_cache(maxsize=16)
def _compile(chat_template: str) -> Template:
    """transformers' compiled template (its extensions, filters and globals), in the bounded environment."""
    from transformers.utils import chat_template_utils

    with _substituted(chat_template_utils, "ImmutableSandboxedEnvironment", BoundedEnvironment):
        return chat_template_utils._cached_compile_jinja_template(chat_template)


# ---------------------------------------------------------------------------------------------------
# The budget

class _Budget:
    def __init__(self):
        self.work, self.steps = WORK, STEPS

    def charge(self, work: int, what: str) -> None:
        self.work -= work
        self.steps -= 1
        if self.work < 0 or self.steps < 0:
            raise SecurityError(f"the template exceeds its budget of {WORK:,} characters read and made, or "
                                f"{STEPS:,} steps (at {what})")


_budget: ContextVar[_Budget | None] = ContextVar("chat_template_budget", default=None)


def _charge(work: int, what: str) -> None:
    budget = _budget.get()
    if budget is not None:  # None: constant folding while compiling, size checks only
        budget.charge(work, what)


def _size(value: Any) -> int:
    return len(value) if isinstance(value, (str, bytes, list, tuple, dict, set, frozenset)) else 0


def _refuse_over(size: int, what: str) -> None:
    if size > CHARACTERS:
        raise SecurityError(f"{what} would make {size:,} characters or items, beyond the template limit of "
                            f"{CHARACTERS:,}")


def _largest_int(values) -> int:
    return max((abs(v) for v in values if isinstance(v, int) and not isinstance(v, bool)), default=0)


def _format_size(text: Any, args=(), kwargs=None) -> int:
    """The most a format string pads to: its largest number (a width or precision), or with ``*`` the largest
    number among its arguments."""
    if not isinstance(text, str):
        return 0
    widths = max((int(n) for n in re.findall(r"\d+", text)), default=0)
    nested = "*" in text or re.search(r"\{[^{}]*\{", text)  # `%*d`, `{:{width}}`: the width is an argument
    return max(widths, _largest_int([*args, *(kwargs or {}).values()]) if nested else 0)


def _replaced_size(text, old="", new="", *_, **__) -> int:
    if not (isinstance(text, str) and isinstance(old, str) and isinstance(new, str)):
        return 0
    return len(text) + (len(text) + 1) * max(len(new) - len(old), 0)


def _indented_size(text, width=4, *_, **__) -> int:
    lines = text.count("\n") + 1 if isinstance(text, str) else 0
    return lines * (width if isinstance(width, int) else _size(width))


def _joined_size(items, separator="", *_, **__) -> int:
    return _size(items) * _size(separator) if isinstance(items, (list, tuple)) else 0


# What an operation that makes far more than it reads would make, from its arguments (the value first, as
# a filter takes it; for a str method, the string it is called on, and for join the items). Any other
# operation is checked after it returns, when what it made is at most a small multiple of what it read.
_GROWTH: dict[str, Callable[..., int]] = {
    "replace": _replaced_size,
    "join": _joined_size,
    "indent": _indented_size,
    "format": lambda text, *args, **kwargs: _format_size(text, args, kwargs),
    "format_map": lambda text, mapping=None, *_: _format_size(text, (), mapping if isinstance(mapping, dict) else {}),
    "tojson": lambda value, *_, indent=None, **__: _largest_int([indent]) * 64,
}
# Operations whose integer arguments (after the value) are widths or counts of what they make: padding,
# batches, slices, wrapping. format's numbers are values, sized by _format_size.
_WIDTH_EXEMPT = ("format", "format_map")


def _checked(name: str, run: Callable[[], Any], data: tuple, kwargs: dict | None = None):
    """``run()`` if what it would make fits; charged what it read and made, which must fit too."""
    kwargs = kwargs or {}
    if name not in _WIDTH_EXEMPT:
        _refuse_over(_largest_int([*data[1:], *kwargs.values()]), f"{name} with a width or count")
    growth = _GROWTH.get(name)
    if growth is not None:
        _refuse_over(growth(*data, **kwargs), name)
    result = run()
    _refuse_over(_size(result), name)
    _charge(1 + sum(map(_size, data)) + _size(result), name)
    return result


def _bounded_filter(name: str, function: Callable) -> Callable:
    @functools.wraps(function)  # keeps jinja2's pass_context / pass_eval_context / pass_environment marks
    def bounded(*args, **kwargs):
        passed = getattr(function, "jinja_pass_arg", None) is not None  # a context or environment goes first
        return _checked(name, lambda: function(*args, **kwargs), args[1:] if passed else args, kwargs)

    bounded.quantkit_bounded = True
    return bounded


class _BoundedFilters(dict):
    """The environment's filters, each run through the budget: those transformers sets later too."""

    def __setitem__(self, name, function):
        bounded = getattr(function, "quantkit_bounded", False)
        super().__setitem__(name, function if bounded else _bounded_filter(name, function))


def _counted_iteration(iterable, body_text: int):
    """A loop's iterable; each iteration is charged a step and the template text its body writes."""
    _charge(1 + _size(iterable), "a loop")
    for item in iterable:
        _charge(1 + body_text, "a loop iteration")
        yield item


def _counted_operand(value):
    """An operand of ``~`` or ``in``, which read (and ``~`` copies) it whole."""
    _charge(1 + _size(value), "a comparison or concatenation")
    return value


def _counted_output(value):
    """Every ``{{ value }}`` written, into the rendered text or into a ``set`` block's."""
    _charge(1 + _size(value), "output")
    return value


_ITERATE, _OPERAND = "quantkit_counted_iteration", "quantkit_counted_operand"
_COUNTING = {_ITERATE: _counted_iteration, _OPERAND: _counted_operand}


def _through(filter_name: str, node, *args):
    return nodes.Filter(node, filter_name, [nodes.Const(a) for a in args], [], None, None, lineno=node.lineno)


class BoundedTemplate(Template):
    def render(self, *args, **kwargs) -> str:
        return "".join(self.generate(*args, **kwargs))

    def generate(self, *args, **kwargs):
        """The rendered pieces, within one budget (that of an enclosing render, as for an included template)."""
        token = _budget.set(_Budget()) if _budget.get() is None else None
        written = 0
        try:
            for piece in super().generate(*args, **kwargs):
                written += len(piece)
                _refuse_over(written, "the rendered text")
                yield piece
        except TemplateError:
            raise
        except Exception as e:  # the template's own failure, whatever Python raised in it
            raise TemplateFailed(str(e)) from e
        finally:
            if token is not None:
                _budget.reset(token)


class BoundedEnvironment(ImmutableSandboxedEnvironment):
    """jinja2's immutable sandbox, within the budget."""

    intercepted_binops = frozenset({"*", "**", "+", "%", "//"})
    template_class = BoundedTemplate

    def __init__(self, *args, **kwargs):
        super().__init__(*args, finalize=_counted_output, **kwargs)
        filters, self.filters = self.filters, _BoundedFilters()
        for name, function in filters.items():
            self.filters[name] = function
        dict.update(self.filters, _COUNTING)  # the counters charge for themselves

    def call_binop(self, context, operator, left, right):
        if operator == "*":
            _refuse_over(max(_size(left), _size(right)) * max(_largest_int([left, right]), 1), "'*'")
        elif operator == "**" and _largest_int([left]) > 1 and isinstance(right, int):
            _refuse_over(right * abs(left).bit_length() // 8, "'**'")
        elif operator == "%":
            _refuse_over(_format_size(left, right if isinstance(right, tuple) else (right,)), "'%'")
        return _checked(operator, lambda: super(BoundedEnvironment, self).call_binop(context, operator, left, right),
                        ())

    def getitem(self, obj, argument):
        return _checked("[]", lambda: super(BoundedEnvironment, self).getitem(obj, argument), ())

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805  (jinja2's signature)
        method_of = getattr(__obj, "__self__", None)
        if not isinstance(method_of, str):  # a macro, a global, a method of a list or dict: charged, not sized
            return _checked("a call", lambda: super(BoundedEnvironment, __self).call(__context, __obj, *args,
                                                                                       **kwargs), ())
        name = __obj.__name__
        data = (*args, method_of) if name == "join" else (method_of, *args)  # items first, as the join filter
        return _checked(name, lambda: super(BoundedEnvironment, __self).call(__context, __obj, *args, **kwargs),
                        data, kwargs)

    def _parse(self, source, name, filename):
        """Loops, and the operands of ``~`` and ``in``, pass through the counting filters."""
        tree = super()._parse(source, name, filename)
        for loop in tree.find_all(nodes.For):
            body_text = sum(len(data.data) for part in loop.body for data in part.find_all(nodes.TemplateData))
            loop.iter = _through(_ITERATE, loop.iter, body_text)
        for concat in tree.find_all(nodes.Concat):
            concat.nodes = [_through(_OPERAND, part) for part in concat.nodes]
        for operand in tree.find_all(nodes.Operand):
            if operand.op in ("in", "notin"):
                operand.expr = _through(_OPERAND, operand.expr)
        tree.set_environment(self)
        return tree
