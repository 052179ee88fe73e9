"""train_adapter's part of each training method: one module each in this package, one entry each in UNITS.

A method is declared once, as a row of tasks/methods.py; its module here subclasses builder.Unit with what only it
does (its trainer and config classes, its dataset, what it arranges once its trainer exists), and the builder
(builder.py) does the rest the same way for every method. tests/test_methods.py checks that every row has its unit
and every unit its row.
"""

from __future__ import annotations

from tasks.train_adapter.builder import Unit
from tasks.train_adapter.methods import grpo, orpo, preference, reward_model, sft

UNITS: dict[str, Unit] = {unit.name: unit for unit in (
    sft.UNIT, preference.DPO, preference.KTO, grpo.UNIT, orpo.UNIT, reward_model.UNIT)}


def unit(name: str) -> Unit:
    """The module's unit of train.method `name`."""
    return UNITS[name]
