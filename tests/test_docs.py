"""Every relative link in README.md and docs/*.md points at a file that exists, and every
``#anchor`` at a heading of that file (GitHub's anchors: lower case, punctuation dropped,
spaces to hyphens, ``-1``, ``-2`` ... for repeated headings)."""

from __future__ import annotations

import ast
import os
import random
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

_FENCE = re.compile(r"^```.*?^```", re.S | re.M)
_CODE = re.compile(r"`[^`\n]*`")
_LINK = re.compile(r"\[[^\]\n]*\]\(([^)\s]+)\)")
_HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.M)


def _prose(text: str) -> str:
    """The text without code blocks (an indented block is four spaces: never a link here)."""
    return _FENCE.sub("", text)


def anchors(text: str) -> set[str]:
    found: set[str] = set()
    for heading in _HEADING.findall(_prose(text)):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        n, candidate = 0, slug
        while candidate in found:
            n += 1
            candidate = f"{slug}-{n}"
        found.add(candidate)
    return found


def broken_links(root: Path) -> list[str]:
    """``file: link (why)`` for each relative link of README.md and docs/*.md that leads nowhere."""
    pages = [root / "README.md", *sorted((root / "docs").glob("*.md"))]
    broken = []
    for page in pages:
        if not page.exists():
            continue
        for target in _LINK.findall(_CODE.sub("", _prose(page.read_text()))):
            if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                continue
            path_part, _, anchor = target.partition("#")
            path = (page.parent / path_part).resolve() if path_part else page
            where = f"{page.relative_to(root)}: {target}"
            if not path.exists():
                broken.append(f"{where} (no file {path_part})")
            elif anchor and path.suffix == ".md" and anchor not in anchors(path.read_text()):
                broken.append(f"{where} (no heading #{anchor} in {path.name})")
    return broken


def test_every_relative_link_and_anchor_of_the_docs_resolves():
    assert (ROOT / "docs").is_dir()
    assert broken_links(ROOT) == []


def test_the_checker_finds_a_missing_file_and_a_missing_anchor(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text(
        "# Top\n\n## Read the table (`show`)\n\n[ok](#read-the-table-show) [ok](docs/a.md#more-1) "
        "[gone](docs/b.md) [bad](docs/a.md#nothing) [web](https://example.com/x) `[code](nowhere.md)`\n\n"
        "```\n[in a block](nowhere.md)\n```\n")
    (tmp_path / "docs" / "a.md").write_text("# A\n\n## More\n\n## More\n\n[back](../README.md#top)\n")
    assert broken_links(tmp_path) == ["README.md: docs/b.md (no file docs/b.md)",
                                      "README.md: docs/a.md#nothing (no heading #nothing in a.md)"]


# --- examples produced by the commands ------------------------------------------------------------

#: A marked block of a page that a command's output fills: ``<!-- example: NAME -->`` ... ``<!-- /example -->``.
_EXAMPLE = re.compile(r"(<!-- example: (?P<name>[\w-]+) .*?-->\n)(?P<body>.*?)(<!-- /example -->)", re.S)


def _recommend_example(tmp_path: Path, monkeypatch, capsys) -> str:
    """``recommend`` on records of the shipped smoke scenario's cells with 1 MiB of device
    memory: what docs/measurement.md shows. Each cell's memory is its strategy's estimate for
    scenarios/smoke.yaml (what a run records as its static bytes), its speed and AUC fixed."""
    from record_factory import make_record, write_run
    from rich.console import Console

    from embbench import cli
    from embbench.launch import memory_estimate
    from embbench.scenario import Cell, load_scenario

    smoke, _ = load_scenario(ROOT / "scenarios" / "smoke.yaml")
    jitter = random.Random(0)

    def cell(strategy, params=None, ms=10.0, **kw):
        steps = [ms / 1000 * (1 + 0.03 * jitter.random()) for _ in range(15)]
        footprint = memory_estimate(smoke, Cell(strategy, params or {}))
        return make_record(strategy, params, step_times=steps, repeats=5, device_bytes=footprint.device_bytes,
                           host_bytes=footprint.host_bytes, **kw)

    def auc(value):  # 2,048 evaluation samples: DeLong's standard error about 0.011
        return {"accuracy": {"train_loss_last10": 0.5, "auc": value, "logloss": 0.5, "eval_samples": 2048,
                             "auc_standard_error": 0.011}}

    records = [
        cell("device", ms=9.1, **auc(0.7502)),
        cell("cpu", ms=31.0, **auc(0.7502)),
        cell("gpu_sharded", {"sharding": "table_wise"}, ms=9.8, **auc(0.7502)),
        cell("freqcache", {"cache_ratio": 0.01, "policy": "lfu"}, ms=16.4, **auc(0.7502)),
        cell("freqcache", {"cache_ratio": 0.05, "policy": "lfu"}, ms=12.2, **auc(0.7502)),
        cell("fae", {"hot_ratio": 0.05, "profile_fraction": 0.2}, ms=13.1, **auc(0.7481)),
        cell("sfctr", {"cache_ratio": 0.15, "pipeline_depth": 2}, ms=14.0, **auc(0.7502)),
        make_record("uvm", status="unsupported", message="needs CUDA"),
    ]
    monkeypatch.chdir(tmp_path)
    write_run(Path("results/runs/smoke"), records)
    monkeypatch.setattr(cli.recommend, "console", Console(width=120, color_system=None, emoji=False))
    argv = ["recommend", "results/runs/smoke", "--device-memory", "1MiB"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    return "".join(f"    {line}".rstrip() + "\n" for line in [f"$ embbench {' '.join(argv)}", *out.rstrip().splitlines()])


def test_the_docs_examples_are_what_the_commands_print(tmp_path, monkeypatch, capsys):
    """Each marked example of docs/measurement.md is the output of its command on fixed
    records; ``EMBBENCH_UPDATE_DOCS=1`` rewrites the blocks (review the diff)."""
    page = ROOT / "docs" / "measurement.md"
    text = page.read_text()
    rendered = {"recommend": _recommend_example(tmp_path, monkeypatch, capsys)}
    blocks = {m["name"]: m["body"] for m in _EXAMPLE.finditer(text)}
    assert set(blocks) == set(rendered), f"{page.name}: marked examples {sorted(blocks)}, expected {sorted(rendered)}"
    if os.environ.get("EMBBENCH_UPDATE_DOCS"):
        page.write_text(_EXAMPLE.sub(lambda m: m[1] + rendered[m["name"]] + m[4], text))
    for name, body in blocks.items():
        assert body == rendered[name], (f"{page.name}: the {name} example is not what the command prints now; "
                                        "rerun with EMBBENCH_UPDATE_DOCS=1 and review the diff")


# --- the fast tier ------------------------------------------------------------------------------

def _marked_slow(node) -> bool:
    return any("mark.slow" in ast.unparse(d) for d in node.decorator_list)


def test_a_test_that_runs_a_shipped_scenario_is_in_the_slow_tier_and_the_readme_says_how_to_skip_it():
    """`pytest -m "not slow"` (the README's fast tier) runs no shipped scenario end to end: a
    test that runs one to success (`run scenarios/...`, not `--dry-run`, exit 0) is marked slow."""
    unmarked = []
    for path in sorted((ROOT / "tests").glob("test_*.py")):
        source = path.read_text()
        for node in ast.parse(source).body:
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_"):
                body = ast.get_source_segment(source, node)
                runs_one = (re.search(r"""["']run["'],\s*["']scenarios/""", body) and "--dry-run" not in body
                            and re.search(r"(returncode|code)\s*==\s*0", body))
                if runs_one and not _marked_slow(node):
                    unmarked.append(f"{path.name}::{node.name}")
    assert unmarked == []
    readme = (ROOT / "README.md").read_text()
    assert '-m "not slow"' in readme and "--durations" in readme


#: The README is a newcomer's path; designs and measured tables live in docs/.
README_MAX_LINES = 400


def test_the_readme_stays_a_newcomers_path_with_its_map_of_the_code():
    """At most 400 lines, the two commands first, and the architecture map naming where each
    part of the code lives now (a map that names a file that moved misleads)."""
    readme = (ROOT / "README.md").read_text()
    lines = readme.splitlines()
    assert len(lines) <= README_MAX_LINES, (f"README.md has {len(lines)} lines, at most {README_MAX_LINES}: move designs "
                                            "and measured tables to docs/ and link them")
    headings = [line for line in lines if line.startswith("## ")]
    assert headings[0] == "## Two commands"
    assert "scripts/setup_env.sh && .venv/bin/embbench run scenarios/smoke.yaml" in readme
    mapped = re.findall(r"^\| `(embbench/[^`]*|baselines/)`", readme, flags=re.MULTILINE)
    assert {"embbench/cli/", "embbench/data/", "embbench/disk/"} <= set(mapped)
    for path in mapped:
        assert (ROOT / path).exists(), f"the README's map names {path}, which does not exist"
    assert "`cache.py`" in readme  # the data cache's machinery, in the data/ row
