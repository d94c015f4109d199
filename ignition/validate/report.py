"""Validation findings: every violation names its rule, where it is, and expected vs found."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Violation:
    rule: str  # a rule id from ignition.catalog.rules, e.g. "BUF-DTYPE"
    where: str  # the file, variant, buffer or field at fault
    message: str  # what was expected and what was found

    def __str__(self) -> str:
        return f"[{self.rule}] {self.where}: {self.message}"

    def as_dict(self) -> dict[str, str]:
        return {"rule": self.rule, "where": self.where, "message": self.message}
