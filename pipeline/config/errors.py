"""ConfigError and the checks every section's `__post_init__` makes with it.

    check(0 < lr <= 1, "trainer.lr", lr, "0 < lr <= 1")
    choice("run.mode", mode, ("async", "sync"))
    id_set("trainer.cpus", "0-3")          # (0, 1, 2, 3), or ConfigError naming the key

Every message has one shape, `config: <key>=<value> is invalid; allowed: <what>`, so a user (and
a test) finds the key to change in the first words.
"""

from __future__ import annotations

from typing import Any, Sequence

from pipeline.config.ids import parse_ids


class ConfigError(ValueError):
    """A bad config value; the message names the key and what is allowed."""


def check(cond: bool, key: str, value: Any, allowed: str) -> None:
    if not cond:
        raise ConfigError(f"config: {key}={value!r} is invalid; allowed: {allowed}")


def choice(key: str, value: str, choices: Sequence[str]) -> None:
    check(value in choices, key, value, "one of " + ", ".join(repr(c) for c in choices))


def id_set(key: str, spec: str, what: str = "core") -> tuple[int, ...]:
    """The ids of `spec` in cpuset syntax ('0', '0-3', '0,2,4-7'; '' -> none)."""
    try:
        return parse_ids(spec, what)
    except ValueError as e:
        raise ConfigError(f"config: {key}={spec!r} is invalid ({e}); allowed: {what} ids like '0', '0-3', "
                          "'0,2,4-7', or '' for none") from None
