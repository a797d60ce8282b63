"""benchmarks/markdown.py: a rerun rewrites the tables and keeps the hand-written notes."""

from benchmarks.markdown import NOTES_HEADING, write_markdown


def test_a_rerun_keeps_the_notes_section(tmp_path):
    p = tmp_path / "r.md"
    write_markdown(p, "# Result\n\n| a | 1 |\n")
    assert p.read_text() == "# Result\n\n| a | 1 |\n"
    p.write_text(p.read_text() + f"\n{NOTES_HEADING}\n\nmeasured by hand: 3.5x\n")
    write_markdown(p, "# Result\n\n| a | 2 |\n")
    assert p.read_text() == f"# Result\n\n| a | 2 |\n\n{NOTES_HEADING}\n\nmeasured by hand: 3.5x\n"
    write_markdown(p, f"# Result\n\n{NOTES_HEADING}\n\nnew notes\n")  # a text with its own notes replaces them
    assert p.read_text().count(NOTES_HEADING) == 1 and "new notes" in p.read_text()
