"""The determinism probe's page and markdown (`verinfer determinism probe`): a row per condition
(sequences, divergent sequences, flips by class) and a row per first divergence (prompt, position,
the two tokens, the reference's top-2 margin there, its class).

Both read the probe's JSON (determinism/probe.py `ProbeResult.to_json`) as a plain dict: the
page is `templates/probe.html.j2` (jinja2, autoescaped: token strings are the endpoint's text);
numbers go through `report.format`."""

from __future__ import annotations

from pathlib import Path

from verinfer.io import atomic_write_text
from verinfer.report import format as fmt

CLASSES = ("near-tie", "large-margin", "no-margin")


def _token(tok, text) -> str:
    """A token as a table shows it: its string (repr, so whitespace shows) and id, or 'end'."""
    if tok is None:
        return "(end)"
    shown = repr(text) if text is not None else repr(tok)
    return f"{shown} ({tok})" if isinstance(tok, int) else shown


def summarize_probe(doc: dict) -> str:
    """One sentence: how many sequences diverged, in which conditions, and of what class."""
    n, d = doc["sequences"], doc["divergent_sequences"]
    if d == 0:
        return (f"deterministic on this probe: all {n} greedy sequences equal their reference, in every condition "
                f"({', '.join(doc['conditions'])})")
    where = ", ".join(f"{k} {c['divergent_sequences']}/{c['sequences']}" for k, c in doc["conditions"].items()
                      if c["divergent_sequences"])
    classes = {c: sum(1 for f in doc["flips"] if f["class"] == c) for c in CLASSES}
    kinds = ", ".join(f"{v} {k}" for k, v in classes.items() if v)
    return f"NOT deterministic: {d} of {n} greedy sequences diverge from their reference ({where}); {kinds}"


def condition_rows(doc: dict) -> list[dict]:
    """A row per condition: sequences, divergent, and the count of each flip class."""
    return [{"condition": k, "sequences": c["sequences"], "divergent": c["divergent_sequences"],
             **{cls: c["classes"].get(cls, 0) for cls in CLASSES}} for k, c in doc["conditions"].items()]


def flip_rows(doc: dict) -> list[dict]:
    """A row per first divergence, margins formatted."""
    return [{"condition": f["condition"], "prompt": f["prompt"], "position": f["position"],
             "reference": _token(f["reference_token"], f["reference_text"]), "token": _token(f["token"], f["text"]),
             "margin": fmt.sig(f["margin"]), "margin_here": fmt.sig(f["margin_here"]), "class": f["class"]}
            for f in doc["flips"]]


def probe_markdown(doc: dict, title: str | None = None) -> str:
    """The probe's result as markdown: the summary, the conditions table, the divergences table."""
    lines = [f"# {title or 'Determinism probe: ' + doc['model']}", "",
             f"{doc['base_url']} (`{doc['model']}`), {doc['prompts']}, compared on {doc['compared_on']}; settings "
             + ", ".join(f"{k} {v}" for k, v in doc["settings"].items()), "", summarize_probe(doc), "",
             "| condition | sequences | divergent | near-tie | large-margin | no-margin |",
             "|---|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['condition']} | {r['sequences']} | {r['divergent']} | {r['near-tie']} | {r['large-margin']} | "
              f"{r['no-margin']} |" for r in condition_rows(doc)]
    if doc["flips"]:
        lines += ["", "| condition | prompt | position | reference token | token | reference margin | margin there "
                      "| class |", "|---|---:|---:|---|---|---:|---:|---|"]
        lines += [f"| {r['condition']} | {r['prompt']} | {r['position']} | `{r['reference']}` | `{r['token']}` | "
                  f"{r['margin']} | {r['margin_here']} | {r['class']} |" for r in flip_rows(doc)]
    return "\n".join(lines) + "\n"


def write_probe_html(doc: dict, path: str | Path) -> Path:
    """Write the probe's page to `path` (atomic, self-contained); return the path."""
    import jinja2

    env = jinja2.Environment(loader=jinja2.PackageLoader("verinfer.report", "templates"), autoescape=True,
                             undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True)
    env.filters.update(sig=fmt.sig)
    page = env.get_template("probe.html.j2").render(
        doc=doc, summary=summarize_probe(doc), conditions=condition_rows(doc), flips=flip_rows(doc), classes=CLASSES)
    return atomic_write_text(path, page)
