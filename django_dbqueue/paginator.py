"""A paginator for the admin's lists that never counts a large table row by row.

Django's admin counts every list with ``COUNT(*)``. On InnoDB that reads the
whole table: with a million archived messages each page of the archive
would take seconds before showing a hundred rows. This paginator asks the
database's statistics for an unfiltered list of a large table, and counts
filtered lists exactly but only up to ``count_cap`` rows. Either way the
page's rows are read by index, so a page costs the same on any table size.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from django.core.paginator import Paginator
from django.db.models import Model, QuerySet
from django.utils.functional import cached_property

from .db.stats import estimated_row_count

if TYPE_CHECKING:
    # Generic in its items for type checkers (django-stubs); Django's is not subscriptable.
    RowPaginator = Paginator[Model]
else:
    RowPaginator = Paginator


class EstimatingPaginator(RowPaginator):
    """``count`` is exact for small or filtered lists, the planner's estimate for large whole tables.

    ``approximate`` tells the template to say "about" (an estimate) or
    "more than" (a count that reached the cap).
    """

    # Below this many rows counting is cheap, and small tables' estimates are poor.
    exact_below = 10_000
    # A filtered count stops here: COUNT(*) over a LIMITed subquery reads at most this many rows.
    count_cap = 100_000

    approximate = ""

    @cached_property
    def count(self) -> int:
        rows = self.object_list
        if not isinstance(rows, QuerySet):
            return super().count
        if not rows.query.where:
            estimate = estimated_row_count(rows.db, rows.model._meta.db_table)
            if estimate is not None and estimate >= self.exact_below:
                self.approximate = "about"
                return estimate
        counted = rows.order_by()[: self.count_cap + 1].count()
        if counted > self.count_cap:
            self.approximate = "more than"
            return self.count_cap
        return counted
