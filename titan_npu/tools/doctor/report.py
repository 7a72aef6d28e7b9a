"""The doctor's report: findings in order, grouped by section, printed as tagged lines."""

from __future__ import annotations

from dataclasses import dataclass, field

LEVELS = ("ok", "info", "warn", "fail", "table")  # "table": a row of a table, printed without a tag


@dataclass
class Finding:
    """One line of the report."""

    level: str  # ok | info | warn | fail
    section: str
    message: str


@dataclass
class Report:
    """Everything the doctor found, in order."""

    findings: list[Finding] = field(default_factory=list)
    facts: dict = field(default_factory=dict)

    def add(self, level: str, section: str, message: str) -> None:
        self.findings.append(Finding(level, section, message))

    def count(self, level: str) -> int:
        return sum(1 for f in self.findings if f.level == level)

    def format(self, levels: tuple[str, ...] = LEVELS) -> str:
        lines, section = [], None
        for f in self.findings:
            if f.level not in levels:
                continue
            if f.section != section:
                section = f.section
                lines.append(section)
            if f.level == "table":
                lines.append(f"         {f.message}")
            else:
                lines.append(f"  [{f.level}]{' ' * (5 - len(f.level))}{f.message}")
        return "\n".join(lines)
