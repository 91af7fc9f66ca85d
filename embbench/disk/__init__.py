"""Rows on a drive: the page layout of a row file, the reader that keeps many reads in flight,
and the probe that measures what a drive (and the reader) can do (issue 43)."""
