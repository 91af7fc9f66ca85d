"""``embbench disk PATH``: what the drive holding PATH can read (random 4 KiB O_DIRECT reads a
second at a few queue depths) beside the reader's own ceiling (:mod:`embbench.disk.probe`)."""

from __future__ import annotations

from embbench.disk.probe import add_arguments, main


def register(sub) -> None:
    parser = sub.add_parser("disk", help="measure a drive's random 4 KiB reads a second (for store: file and "
                                         "curve --tiers) beside the reader's ceiling")
    add_arguments(parser)
    parser.set_defaults(func=main)
