"""Memory budgets in CI: a budgets file, its evaluation against a baseline, JUnit and Markdown.

``load_budgets`` -> ``resolve_entries`` -> ``check`` (estimate, or ``measure.measure`` with
``--measure``) -> ``render.junit_xml`` / ``render.markdown``; ``new_baseline`` is what
``--update-baseline`` writes. Everything but ``measure`` is pure and never prints.
"""

from memplan.check.evaluate import (
    CheckReport,
    EntryResult,
    Resolved,
    check,
    load_baseline,
    load_budgets,
    new_baseline,
    resolve_entries,
)
from memplan.check.spec import Baseline, BudgetsFile, Entry

__all__ = [
    "Baseline",
    "BudgetsFile",
    "CheckReport",
    "Entry",
    "EntryResult",
    "Resolved",
    "check",
    "load_baseline",
    "load_budgets",
    "new_baseline",
    "resolve_entries",
]
