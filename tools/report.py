"""The results book (docs/results) rebuilt from its data: every table of every page from the data file its
marker names, every plot a page shows from the data files data/plots.json names.

    python -m tools.report                  # rewrite the tables and redraw the plots; one line a page
    python -m tools.report --check          # change nothing; exit 1 naming each table or plot that differs
    python -m tools.report --root DIR --page benchmarks.md      # another copy of the book; some pages only

A table sits between two markers, its rows rendered from the data file (the path relative to the page):

    <!-- table: data/faults/chaos_one_generator.csv align=:-:::- -->
    | stop | what | ... |
    |---:|---|...|
    <!-- /table -->

The file is a CSV (the header first, each cell as the page shows it), or a JSON file {"columns": [...],
"rows": [[...]]}; with `view=NAME` it is the raw data a tool wrote (a file or a folder), which
tools.lib.views.NAME turns into the table, computing every figure. A path starting with / is from the
repository's root: a data file a tool keeps as its own input (the planner's records in tools/plan/data). `align` gives a character a column,
"-" left and ":" right (all left without it); the table takes the marker's indentation.

A plot is an image under img/ that a page links or names (docs/results/img/NAME.png). data/plots.json
says how each is drawn ({"draw": NAME, ...}: tools.lib.views.PLOTS[NAME], every "data/..." string in
the entry a data file it reads) or why it cannot be ({"not_rebuildable": "..."}). A drawn PNG carries
the SHA-256 of its entry and its data files (text chunk "data-sha256"): --check compares that, not the
bytes.

Exit: 0 everything matches its data; 1 (--check) a table or plot differs, or a table has no markers;
2 a marker or plot entry names a missing or malformed data file, or a page shows a plot plots.json
does not list (one line naming the file).
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import io
import json
import re
import sys
from pathlib import Path

from tools.lib.report import markdown_table, png_text
from tools.lib.views import PLOTS, VIEWS, DataError

REPO = Path(__file__).resolve().parents[1]
ROOT = REPO / "docs" / "results"
START = re.compile(r"^(?P<indent>[ \t]*)<!-- table: (?P<path>\S+)(?P<opts>(?:\s+[a-z]+=\S+)*)\s*-->\s*$")
END = re.compile(r"^[ \t]*<!-- /table -->\s*$")
IMAGE = re.compile(r"(?:docs/results/|(?<![\w/.-]))img/([\w.-]+\.png)")
DIGEST = "data-sha256"


class PageError(Exception):
    """A page or data file the book cannot be rebuilt from (exit 2)."""


def read_table(path: Path, view: str | None) -> tuple[list[str], list[list[str]]]:
    """The header and rows a marker's data file renders to."""
    if not path.exists():
        raise DataError(path, "missing")
    if view:
        if view not in VIEWS:
            raise DataError(path, f"no view {view!r} in tools.lib.views")
        return VIEWS[view](path)
    if path.suffix == ".csv":
        try:
            rows = list(csv.reader(io.StringIO(path.read_text(encoding="utf-8"))))
        except (csv.Error, UnicodeDecodeError) as e:
            raise DataError(path, str(e)) from None
        if not rows:
            raise DataError(path, "empty")
        return rows[0], rows[1:]
    if path.suffix == ".json":
        try:
            d = json.loads(path.read_text(encoding="utf-8"))
            return [str(c) for c in d["columns"]], [[str(c) for c in r] for r in d["rows"]]
        except (ValueError, KeyError, TypeError) as e:
            raise DataError(path, f"not a {{\"columns\", \"rows\"}} table ({e})") from None
    raise DataError(path, "neither .csv nor .json, and no view=")


def render(root: Path, page: Path, line: str) -> tuple[str, list[str]]:
    """A start marker's table: its name (the data path, and the view) and its lines."""
    m = START.match(line)
    opts = dict(o.split("=", 1) for o in m.group("opts").split())
    rel = m.group("path")
    path = (REPO / rel.lstrip("/") if rel.startswith("/") else page.parent / rel).resolve()
    try:
        header, rows = read_table(path, opts.get("view"))
    except (OSError, ValueError, KeyError, IndexError, TypeError, StopIteration) as e:  # a view reading malformed data
        raise DataError(path, f"{type(e).__name__}: {e}") from None
    align = opts.get("align", "-" * len(header))
    if len(align) != len(header) or set(align) - {"-", ":"}:
        raise DataError(path, f"align={align} does not fit its {len(header)} columns (one of - or : each)")
    for r in rows:
        if len(r) != len(header):
            raise DataError(path, f"a row of {len(r)} cells under a header of {len(header)}: {r}")
    table = markdown_table(header, rows, align)
    name = m.group("path") + (f" (view={opts['view']})" if "view" in opts else "")
    return name, [m.group("indent") + t for t in table.splitlines()]


def rebuild_text(root: Path, page: Path, text: str) -> tuple[str, list[tuple[str, bool]], list[int]]:
    """The page with every marked table rendered again: (text, [(data path, changed)], lines of tables
    outside markers)."""
    lines = text.split("\n")
    out, tables, loose = [], [], []
    i, fence = 0, False
    while i < len(lines):
        line = lines[i]
        if line.lstrip().startswith("```"):
            fence = not fence
        if not fence and START.match(line):
            j = next((k for k in range(i + 1, len(lines)) if END.match(lines[k])), None)
            if j is None:
                raise PageError(f"{page}: line {i + 1}: a table marker without its <!-- /table -->")
            name, table = render(root, page, line)
            tables.append((name, lines[i + 1:j] != table))
            out += [line, *table, lines[j]]
            i = j + 1
            continue
        if not fence and line.lstrip().startswith("|") and not (out and out[-1].lstrip().startswith("|")):
            loose.append(i + 1)
        out.append(line)
        i += 1
    return "\n".join(out), tables, loose


def plot_specs(root: Path) -> dict[str, dict]:
    path = root / "data" / "plots.json"
    if not path.exists():
        return {}
    try:
        specs = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as e:
        raise DataError(path, str(e)) from None
    for img, spec in specs.items():
        if not isinstance(spec, dict) or not ("not_rebuildable" in spec or spec.get("draw") in PLOTS):
            raise DataError(path, f"{img}: needs \"draw\" (one of {sorted(PLOTS)}) or \"not_rebuildable\"")
    return specs


def data_files(root: Path, spec) -> list[Path]:
    """Every "data/..." string in a plot's entry, as a path (a folder: its files)."""
    if isinstance(spec, dict):
        return [p for v in spec.values() for p in data_files(root, v)]
    if isinstance(spec, list):
        return [p for v in spec for p in data_files(root, v)]
    if isinstance(spec, str) and spec.startswith("data/"):
        p = root / spec
        if not p.exists():
            raise DataError(p, "missing")
        return sorted(x for x in p.rglob("*") if x.is_file()) if p.is_dir() else [p]
    return []


def digest(root: Path, img: str, spec: dict) -> str:
    h = hashlib.sha256(json.dumps({img: spec}, sort_keys=True).encode())
    for p in data_files(root, spec):
        h.update(p.relative_to(root).as_posix().encode() + b"\0" + p.read_bytes())
    return h.hexdigest()


def shown(text: str) -> list[str]:
    """The images under img/ a page links or names, in order, once each."""
    return list(dict.fromkeys(m.group(1) for m in IMAGE.finditer(text)))


def run(root: Path, check: bool, pages: list[str]) -> int:
    specs = plot_specs(root)
    bad, done = 0, set()
    for page in sorted(root.glob("*.md")):
        if pages and page.name not in pages:
            continue
        text = page.read_text(encoding="utf-8")
        new, tables, loose = rebuild_text(root, page, text)
        drawn, fixed, stale = 0, [], []
        for name in shown(text):
            img = f"img/{name}"
            if img not in specs:
                raise PageError(f"{page}: shows {img}, which {root / 'data' / 'plots.json'} does not list")
            spec = specs[img]
            if "not_rebuildable" in spec:
                fixed.append(img)
                if check:
                    print(f"{page.name}: {img} not rebuildable: {spec['not_rebuildable']}")
                continue
            d = digest(root, img, spec)
            if check:
                if not (root / img).exists() or png_text(root / img).get(DIGEST) != d:
                    stale.append(img)
            else:
                if img not in done:  # a plot two pages show is drawn once
                    try:
                        PLOTS[spec["draw"]](root, spec, root / img, {DIGEST: d})
                    except (KeyError, ValueError, TypeError, IndexError) as e:
                        raise DataError(root / "data" / "plots.json", f"{img}: {type(e).__name__}: {e}") from None
                    done.add(img)
                drawn += 1
        for n in loose:
            print(f"{page.name}: line {n}: a table without <!-- table: ... --> markers")
        bad += len(loose)
        changed = [n for n, c in tables if c]
        if check:
            for n in changed:
                print(f"{page.name}: table {n} differs from what its data renders")
            for img in stale:
                print(f"{page.name}: plot {img} was not drawn from its data as it is now")
            bad += len(changed) + len(stale)
        else:
            if new != text:
                page.write_text(new, encoding="utf-8")
            print(f"{page.name}: {len(tables)} table{'s' * (len(tables) != 1)} rebuilt ({len(changed)} changed), "
                  f"{drawn} plot{'s' * (drawn != 1)} redrawn"
                  + (f", {len(fixed)} not rebuildable ({', '.join(fixed)})" if fixed else ""))
    if check:
        print(f"{bad} table{'s' * (bad != 1)} or plots differ from their data" if bad else
              "every table and plot matches its data")
    return 1 if check and bad else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true", help="change nothing; exit 1 if a table or plot differs")
    ap.add_argument("--root", type=Path, default=ROOT, help="the book's folder (default docs/results)")
    ap.add_argument("--page", action="append", default=[], help="only this page (a file name; repeatable)")
    a = ap.parse_args(argv)
    try:
        return run(a.root.resolve(), a.check, a.page)
    except DataError as e:
        print(f"error: {e.path}: {e.why}", file=sys.stderr)
    except PageError as e:
        print(f"error: {e}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
