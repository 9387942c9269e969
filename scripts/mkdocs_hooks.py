"""MkDocs hooks (mkdocs.yml ``hooks:``): checks on the built pages.

A Sphinx role left in a docstring (``:func:`enqueue```) renders on the API
reference as the raw role followed by code, which reads as noise. mkdocstrings
renders Markdown: docstrings name code in backticks (or as cross-references,
``[enqueue][django_dbqueue.enqueue]``). Every role left on a built page is
logged as a warning, so that ``mkdocs build --strict`` fails and names it.
"""

import logging
import re

log = logging.getLogger("mkdocs.plugins.dbqueue")

# As rendered: ":func:" then the inline code that followed it (or, in a code
# span or an escaped block, the backtick itself).
RAW_ROLE = re.compile(r":(?:py:)?(?:mod|func|class|meth|attr|exc|data|obj|const|ref|doc):(?:<code>|`)")


def on_page_content(html, page, config, files):
    for match in RAW_ROLE.finditer(html):
        context = re.sub(r"<[^>]+>", "", html[match.start() : match.end() + 60]).split("\n")[0]
        log.warning("%s: a Sphinx role left raw in a docstring renders as %r", page.file.src_path, context)
    return html
