"""The results book is rebuilt from its data by `python -m tools.report` (tools/report.py): every table
between its markers, every plot from data/plots.json. No engines, no network: pages, CSV and JSON."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tools import report
from tools.lib.report import png_text

REPO = Path(__file__).resolve().parents[1]
BOOK = REPO / "docs" / "results"


@pytest.fixture
def book(tmp_path: Path) -> Path:
    """A copy of the book's pages and data (its images left out: no test here needs the committed ones)."""
    root = tmp_path / "results"
    shutil.copytree(BOOK, root, ignore=shutil.ignore_patterns("img"))
    return root


def test_check_passes_on_the_book_as_committed():
    p = subprocess.run([sys.executable, "-m", "tools.report", "--check"], cwd=REPO, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "every table and plot matches its data" in p.stdout


def test_a_value_changed_in_a_data_file_changes_its_table_and_fails_check_naming_it(book: Path, capsys):
    csv = book / "data" / "faults" / "chaos_one_generator.csv"
    text = csv.read_text()
    assert "| 1 | engine core" in (book / "faults.md").read_text() and ",9.0 s," in text
    csv.write_text(text.replace(",9.0 s,", ",9.5 s,", 1))
    assert report.main(["--root", str(book), "--check", "--page", "faults.md"]) == 1
    out = capsys.readouterr().out
    assert "faults.md: table data/faults/chaos_one_generator.csv differs" in out
    assert "9.5 s" not in (book / "faults.md").read_text()  # --check changes nothing

    assert report.main(["--root", str(book), "--page", "faults.md"]) == 0
    assert "faults.md: 2 tables rebuilt (1 changed)" in capsys.readouterr().out
    assert "| 1 | engine core (a weight update's pause outstanding) | 9.5 s |" in (book / "faults.md").read_text()
    assert report.main(["--root", str(book), "--check", "--page", "faults.md"]) == 0


def test_a_table_computed_from_raw_data_follows_the_raw_data(book: Path, capsys):
    path = book / "data" / "elastic" / "elastic.json"
    d = json.loads(path.read_text())
    d["run_a"]["phases"][0]["steps_per_s"] = 0.99
    path.write_text(json.dumps(d))
    assert report.main(["--root", str(book), "--check", "--page", "elastic-generators.md"]) == 1
    assert "table data/elastic/elastic.json (view=elastic_phases) differs" in capsys.readouterr().out
    assert report.main(["--root", str(book), "--page", "elastic-generators.md"]) == 0
    assert "| 1 generator (before) | 1-10 | 0.99 | 218 |" in (book / "elastic-generators.md").read_text()


def test_a_marker_naming_a_missing_or_malformed_file_exits_2_naming_it(book: Path, capsys):
    page = book / "cluster.md"
    good = page.read_text()
    page.write_text(good + "\n<!-- table: data/cluster/nowhere.csv -->\n| a |\n|---|\n<!-- /table -->\n")
    assert report.main(["--root", str(book), "--check"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cluster/nowhere.csv" in err[0] and "missing" in err[0]

    (book / "data" / "cluster" / "nowhere.csv").write_text("a,b\n1,2,3\n")
    assert report.main(["--root", str(book), "--check"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cluster/nowhere.csv" in err[0] and "3 cells under a header of 2" in err[0]


def test_a_table_without_markers_fails_check(book: Path, capsys):
    page = book / "cluster.md"
    page.write_text(page.read_text() + "\n| a | b |\n|---|---|\n| 1 | 2 |\n")
    assert report.main(["--root", str(book), "--check", "--page", "cluster.md"]) == 1
    assert "a table without <!-- table: ... --> markers" in capsys.readouterr().out


def test_a_plot_is_drawn_from_its_data_and_checked_by_its_digest(tmp_path: Path, capsys):
    root = tmp_path / "book"
    (root / "data" / "bench").mkdir(parents=True)
    shutil.copy(BOOK / "data" / "pipeline_smollm2" / "results.json", root / "data" / "bench" / "results.json")
    (root / "data" / "plots.json").write_text(json.dumps({
        "img/modes.png": {"draw": "modes", "results": "data/bench/results.json", "title": "a test"},
        "img/gone.png": {"not_rebuildable": "its runs were not kept"}}))
    (root / "page.md").write_text("# A page\n\n![modes](img/modes.png) and [the other](img/gone.png)\n")

    assert report.main(["--root", str(root), "--check"]) == 1  # not drawn yet
    assert "page.md: plot img/modes.png was not drawn from its data as it is now" in capsys.readouterr().out
    assert report.main(["--root", str(root)]) == 0
    assert "page.md: 0 tables rebuilt (0 changed), 1 plot redrawn, 1 not rebuildable (img/gone.png)" in \
        capsys.readouterr().out
    png = root / "img" / "modes.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and len(png_text(png).get(report.DIGEST, "")) == 64
    assert report.main(["--root", str(root), "--check"]) == 0
    assert "page.md: img/gone.png not rebuildable: its runs were not kept" in capsys.readouterr().out

    results = root / "data" / "bench" / "results.json"
    d = json.loads(results.read_text())
    d["summary"][0]["samples_per_s"]["median"] = 2.0
    results.write_text(json.dumps(d))
    assert report.main(["--root", str(root), "--check"]) == 1
    assert "page.md: plot img/modes.png was not drawn" in capsys.readouterr().out

    (root / "page.md").write_text("![unlisted](img/unlisted.png)\n")
    assert report.main(["--root", str(root), "--check"]) == 2
    assert "img/unlisted.png" in capsys.readouterr().err
