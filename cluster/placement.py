"""Which models each replica serves, by a rule.

* ``"all"``: every model on every replica.
* a count per model: ``{"resnet18": 2, "inceptionv3": 4}`` (a model not named gets
  ``default``, itself "all" or a count), or one int for every model.

Placement is deterministic and balanced: models are placed in the order given, each on
the ``count`` replicas serving the fewest models so far (ties to the lowest index), so
that the numbers of models per replica differ by at most one when the counts allow it.
:func:`parse_rule` reads a rule from text (``all``, ``2``, ``resnet18=2,inceptionv3=4``,
``resnet18=2,*=1``), as a command-line option or a config file writes it.
"""
from __future__ import annotations

from typing import Mapping, Sequence

ALL = "all"
Rule = str | int | Mapping[str, "int | str"]


def place(models: Sequence[str], n_replicas: int, rule: Rule = ALL,
          default: int | str = ALL) -> list[frozenset[str]]:
    """The models each of ``n_replicas`` replicas serves, by ``rule`` (see the module
    docstring). ValueError for a count outside 1..n_replicas, a model named twice, or a
    rule naming a model that is not in ``models``."""
    if type(n_replicas) is not int or n_replicas < 1:
        raise ValueError(f"need at least one replica, got {n_replicas!r}")
    if len(set(models)) != len(models):
        raise ValueError(f"a model is named twice in {list(models)}")
    counts = _counts(models, n_replicas, rule, default)
    served: list[set[str]] = [set() for _ in range(n_replicas)]
    for m in models:
        k = counts[m]
        for r in sorted(range(n_replicas), key=lambda i: (len(served[i]), i))[:k]:
            served[r].add(m)
    return [frozenset(s) for s in served]


def _counts(models: Sequence[str], n: int, rule: Rule, default: int | str) -> dict[str, int]:
    if isinstance(rule, Mapping):
        unknown = sorted(set(rule) - set(models))
        if unknown:
            raise ValueError(f"the placement names unknown model(s) {', '.join(unknown)}; "
                             f"the models are {', '.join(models)}")
        per = {m: rule.get(m, default) for m in models}
    else:
        per = {m: rule for m in models}
    out = {}
    for m, c in per.items():
        if c == ALL:
            out[m] = n
        elif type(c) is int and 1 <= c <= n:
            out[m] = c
        else:
            raise ValueError(f"model {m}: a placement count is 'all' or an int from 1 to "
                             f"the {n} replica(s), got {c!r}")
    return out


def parse_rule(text: str) -> Rule:
    """``all``, ``N``, or ``model=N,...`` (``*=N`` or ``*=all``: the others') as a rule;
    the ``*`` entry, if any, comes back under the key ``"*"`` (pass it as ``default``)."""
    text = text.strip()
    if text == ALL:
        return ALL
    if text.isdigit():
        return int(text)
    rule: dict[str, int | str] = {}
    for part in text.split(","):
        name, eq, count = (s.strip() for s in part.partition("="))
        if not eq or not name or not (count.isdigit() or count == ALL):
            raise ValueError(f"placement {text!r}: write 'all', a count, or model=count "
                             f"pairs separated by commas (bad part {part.strip()!r})")
        if name in rule:
            raise ValueError(f"placement {text!r}: {name} is named twice")
        rule[name] = ALL if count == ALL else int(count)
    return rule


def place_text(models: Sequence[str], n_replicas: int, text: str) -> list[frozenset[str]]:
    """:func:`place` with a rule written as :func:`parse_rule` reads it."""
    rule = parse_rule(text)
    if isinstance(rule, dict):
        default = rule.pop("*", ALL)
        return place(models, n_replicas, rule, default)
    return place(models, n_replicas, rule)
