"""Writing a result's markdown: the tables are regenerated from the JSON on every run, and the
hand-written notes at the end of the file (from the heading NOTES_HEADING on) are kept."""

from __future__ import annotations

from pathlib import Path

from verinfer.io import atomic_write_text

NOTES_HEADING = "## Notes (moved from the README)"


def write_markdown(path: str | Path, text: str) -> Path:
    """Write `text` to `path` atomically, followed by the notes section of the file it replaces."""
    path = Path(path)
    old = path.read_text(encoding="utf-8") if path.is_file() else ""
    at = old.find(NOTES_HEADING)
    notes = old[at:] if at >= 0 and NOTES_HEADING not in text else ""
    body = text.rstrip("\n") + "\n"
    return atomic_write_text(path, body + ("\n" + notes if notes else ""))
