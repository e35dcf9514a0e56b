"""The trace browser: one self-contained HTML page to look at a trace, or a pair (``layerdiff
show TRACE --html F``). :mod:`.browse` builds it; :mod:`.data` computes what it shows from the
index, a diff and streamed reads; :mod:`.sections`, :mod:`.hist`, :mod:`.plots` and
:mod:`.svg` draw it."""

from layerdiff.report.browser.browse import Browser, browse, write_browser

__all__ = ["Browser", "browse", "write_browser"]
