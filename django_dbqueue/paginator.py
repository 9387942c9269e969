"""A paginator for the admin's lists that never counts a large table row by row.

Django's admin counts every list with ``COUNT(*)``. On InnoDB that reads the
whole table: with a million archived messages each page of the archive
would take seconds before showing a hundred rows. This paginator asks the
database's statistics for an unfiltered list of a large table, and the
planner (``EXPLAIN``) for a filtered list of a large table, checking that
estimate by counting at most ``checked_pages`` pages; any other list is counted
exactly but only up to ``count_cap`` rows. Either way the page's rows are
read by index, so a page costs about the same on any table size.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from django.core.paginator import Paginator
from django.db.models import Model, QuerySet
from django.utils.functional import cached_property

from .db.stats import estimated_match_count, estimated_row_count, without_jit

if TYPE_CHECKING:
    # Generic in its items for type checkers (django-stubs); Django's is not subscriptable.
    RowPaginator = Paginator[Model]
else:
    RowPaginator = Paginator


class EstimatingPaginator(RowPaginator):
    """``count`` is exact for small lists and few matches, the planner's estimate for many rows of a large table.

    ``approximate`` tells the template to say "about" (an estimate) or
    "more than" (a count that reached the cap).
    """

    # Below this many rows counting is cheap, and small tables' estimates are poor.
    exact_below = 10_000
    # A filtered count stops here: COUNT(*) over a LIMITed subquery reads at most this many rows.
    count_cap = 100_000
    # A filtered list the planner puts at exact_below rows or more is counted up to this many pages: fewer
    # found is the exact count (the planner was wrong), as many shows the planner's estimate.
    checked_pages = 2

    approximate = ""

    @cached_property
    def count(self) -> int:
        rows = self.object_list
        if not isinstance(rows, QuerySet):
            return super().count
        table = estimated_row_count(rows.db, rows.model._meta.db_table)
        if table is not None and table >= self.exact_below:
            if not rows.query.where:
                self.approximate = "about"
                return table
            # Filtered: counting the matches of a large table costs in proportion to them (up to the cap).
            with without_jit(rows.db):
                guess = estimated_match_count(rows)
                # Only where most of the table matches: there counting is what costs, and the check's
                # short scan finds its rows at once. A guess of a few matches may be far off, and a short
                # LIMIT over it can lead the planner to scan the table for them: counted as below.
                if guess is not None and guess >= self.exact_below and guess * 2 >= table:
                    enough = min(self.checked_pages * self.per_page, self.count_cap)
                    checked = rows.order_by()[:enough].count()
                    if checked < enough:
                        return checked
                    self.approximate = "about"
                    return max(guess, checked)
        counted = rows.order_by()[: self.count_cap + 1].count()
        if counted > self.count_cap:
            self.approximate = "more than"
            return self.count_cap
        return counted
