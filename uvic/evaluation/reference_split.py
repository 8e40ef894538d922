"""Results scored against different reference statistics never share a table column or line.

A result's `reference_digest` names the statistics it was scored against. Where the results
of one protocol (in a dataset, or a release row) have several, the protocol gets a column or
line per reference (`ref <8 hex digits>`; `ref unknown` last), the best FID is picked within
each, and a note under the table names every file of each (docs/evaluation.md).
"""

from __future__ import annotations

import string
from collections.abc import Hashable
from typing import Any

UNKNOWN = "unknown"  # how a result without `reference_digest` is named


def digest_of(result: dict[str, Any]) -> str | None:
    """The result's `reference_digest` (None: written before results recorded one);
    ValueError naming the file if it is no hex digest."""
    digest = result.get("reference_digest")
    if digest is None:
        return None
    if not (isinstance(digest, str) and digest and set(digest) <= set(string.hexdigits)):
        raise ValueError(f"{result.get('_path', 'result')}: reference_digest {digest!r} is "
                         "not a hex digest (a result JSON of eval/fid.py writes one)")
    return digest.lower()


def digest_order(digest: str | None) -> tuple[bool, str]:
    """Sort key of a column's or line's reference: known digests in hex order, unknown last."""
    return digest is None, digest or ""


def short(digest: str | None) -> str:
    """A reference as the tables name it: its digest's first 8 hex digits, or `unknown`."""
    return digest[:8] if digest else UNKNOWN


class ReferenceSplit:
    """The result files of every (place, protocol) by reference digest, a place being what
    a table sets protocols apart within (a dataset for Table 3, a release row), the
    protocol any hashable key (`uvic.evaluation.protocols.Protocol` there)."""

    def __init__(self) -> None:
        self.files: dict[tuple[Hashable, Hashable], dict[str | None, list[str]]] = {}

    def add(self, place: Hashable, protocol: Hashable, result: dict[str, Any]) -> str | None:
        """Record a result; returns its digest, the third part of its column's key."""
        digest = digest_of(result)
        name = str(result.get("_path") or result.get("checkpoint", "result"))
        self.files.setdefault((place, protocol), {}).setdefault(digest, []).append(name)
        return digest

    def tag(self, place: Hashable, protocol: Hashable, digest: str | None) -> str:
        """`, ref <8 hex>` (or `, ref unknown`) for a protocol split by reference; else ""."""
        return f", ref {short(digest)}" if len(self.files.get((place, protocol), {})) > 1 else ""

    def notes(self, titles: dict[tuple[Hashable, Hashable], str], marked: str) -> list[str]:
        """The note under a table whose protocols were split by reference: for each split
        (place, protocol), titled as `titles` says, every result file of each reference.
        `marked` is what the table splits ("columns", "lines"). Empty if none was split."""
        split = [(key, by) for key, by in self.files.items() if len(by) > 1]
        if not split:
            return []
        lines = ["", f"Results of one protocol scored against different reference statistics "
                 f"(reference digests differ; `ref unknown`: recorded before results named "
                 f"their reference) are NOT comparable: each reference has its own "
                 f"{marked}, and the best FID is picked within it only.", ""]
        for key, by in split:
            refs = "; ".join(f"ref {short(d)}: {', '.join(by[d])}"
                             for d in sorted(by, key=digest_order))
            lines.append(f"- {titles[key]}: {refs}")
        return lines
