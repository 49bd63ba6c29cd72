"""The option types and values `ckpt`'s commands share."""

from __future__ import annotations

import json
import math
from typing import Any

import click

from ckptstore.errors import CkptError
from ckptstore.paths import symlink_loops
from ckptstore.repo import LOSSY_LEVELS, EncodingSettings

LEVEL_NAMES = list(LOSSY_LEVELS)


class Seconds(click.FloatRange):
    """A number of seconds from `low` up to about 30 years: NaN, which slips through every range, and inf refused."""

    def __init__(self, low: float = 0.0, min_open: bool = False) -> None:
        super().__init__(low, 1e9, min_open=min_open)  # past ~9e9 s the waits' timeouts overflow

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        seconds = super().convert(value, param, ctx)
        if math.isnan(seconds):
            self.fail("nan is not a number of seconds", param, ctx)
        return seconds


class PathGiven(click.Path):
    """A path that is not empty: Path("") is ".", so `ckpt commit "$UNSET"` committed the whole folder."""

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if isinstance(value, str) and not value:
            self.fail("is empty (a variable not set?): pass a path", param, ctx)
        if self.exists and isinstance(value, str) and symlink_loops(value):  # click said "does not exist" of it
            self.fail(f"{value!r} is or passes through a symlink that leads back to itself (a loop): remove or "
                      "repoint it", param, ctx)
        return super().convert(value, param, ctx)


class UrlGiven(click.types.StringParamType):
    """A URL or folder that is not empty, and nothing more checked here (a folder may be one the user cannot list)."""

    name = "url"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if isinstance(value, str) and not value:
            self.fail("is empty (a variable not set?): pass a URL or a folder", param, ctx)
        return super().convert(value, param, ctx)


class TextGiven(click.types.StringParamType):
    """A name or pattern that is not empty: `--branch ""` and `--only ""` failed later, exit 1, unlike `-o ""`."""

    name = "text"

    def __init__(self, what: str) -> None:
        self.what = what

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if isinstance(value, str) and not value:
            self.fail(f"is empty (a variable not set?): pass {self.what}", param, ctx)
        return super().convert(value, param, ctx)


def max_chain_value(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """--max-chain checked by the setting's own rule before anything is made: a wrong one exits 2, as --lossy's."""
    if value is not None:
        try:
            EncodingSettings(max_chain=value)
        except CkptError as exc:
            raise click.BadParameter(str(exc), ctx, param) from None
    return value


def given_once(ctx: click.Context, param: click.Parameter, values: tuple[Any, ...]) -> Any:
    """The value of a `multiple=True` option meant once: given twice, the last no longer wins unsaid."""
    if len(values) > 1:
        raise click.BadParameter(f"given {len(values)} times ({', '.join(map(str, values))}): give it once", ctx, param)
    return values[0] if values else None


def knob_values(values: tuple[str, ...]) -> dict[str, Any]:
    """--knob NAME=VALUE pairs, for `knobs=` (as **knobs, a name such as step or blocking was commit's own argument)."""
    knobs = {}
    for item in values:
        key, sep, value = item.partition("=")
        if not sep:
            raise click.BadParameter(f"{item!r} is not NAME=VALUE", param_hint="--knob")
        if key in knobs:  # the last one won without a word
            raise click.BadParameter(f"{key!r} is given twice", param_hint="--knob")
        try:
            knobs[key] = json.loads(value)
        except json.JSONDecodeError:
            knobs[key] = value
    if knobs:  # a typo is a usage error (exit 2) whether or not a lossy level was given
        from ckptstore.repo import check_knobs  # loads the commit layer: only with --knob

        try:
            check_knobs(knobs)
        except CkptError as exc:
            raise click.BadParameter(str(exc), param_hint="--knob") from None
    return knobs


_LOSS = "--max-loss-change"


def percentage(text: str | None) -> float | None:
    """"0.1%" as 0.001; a bare number is refused: 0.1 read as a fraction was 100 times the 0.1% a user meant."""
    if text is None:
        return None
    try:
        value = float(text.removesuffix("%")) / 100
    except ValueError:
        raise click.BadParameter(f"{text!r}: expected a percentage such as 0.1%", param_hint=_LOSS) from None
    if not value >= 0:  # before the advice below, which would offer "-1%" or "nan%"
        raise click.BadParameter(f"{text!r}: must be a percentage of zero or more, such as 0.1%", param_hint=_LOSS)
    if not text.endswith("%"):
        raise click.BadParameter(f"{text!r}: write it as a percentage, {text}% or {float(text) * 100:g}%, so it "
                                 "cannot be read 100 times too loose or too tight", param_hint=_LOSS)
    return value


def metric_values(values: tuple[str, ...]) -> dict[str, float]:
    metrics = {}
    for item in values:
        key, sep, value = item.partition("=")
        key = key.strip()  # ' loss = 1' names the metric `--keep-best loss` looks for
        if key in metrics:  # the last one won without a word
            raise click.BadParameter(f"{key!r} is given twice", param_hint="--metric")
        try:
            metrics[key] = float(value)
        except ValueError:
            sep = ""
        if not sep or not key:
            raise click.BadParameter(f"{item!r} is not KEY=NUMBER", param_hint="--metric")
    return metrics
