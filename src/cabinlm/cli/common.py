"""What the command modules share: messages on stderr, profiles by name, and precision choices."""

from __future__ import annotations

from typing import Callable

import typer

from cabinlm.contract.precision import WeightFormat


def err(msg: str) -> None:
    typer.echo(f"error: {msg}", err=True)


def info(msg: str) -> None:
    typer.echo(msg, err=True)


def load_profile(name: str):
    from cabinlm.profiles import load_profile as load

    return load(name)


def weight_formats(*members: WeightFormat) -> Callable[[str], WeightFormat]:
    """An option parser that takes only some WeightFormat values (the ones an option can use) and
    refuses the rest as a choice option would: exit 2, naming the value and the choices."""

    def parse(value: str | WeightFormat) -> WeightFormat:
        for member in members:
            if value == member.value or value is member:
                return member
        raise typer.BadParameter(f"{value!r} is not one of {', '.join(repr(m.value) for m in members)}.")

    return parse


def choices(*members: WeightFormat) -> str:
    """The metavar of a weight_formats option, as typer writes an enum's: <fp32|int8|int4>."""
    return "<" + "|".join(m.value for m in members) + ">"
