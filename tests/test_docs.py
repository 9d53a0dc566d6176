"""Code comments cite doc sections by name (the doc file, a comma, the heading in double
quotes); every cited section
exists, and README links the architecture and performance docs."""
from __future__ import annotations

import pathlib
import re

REPO = pathlib.Path(__file__).resolve().parents[1]
CITE = re.compile(r'docs/(NOTES|ARCHITECTURE|PERFORMANCE)\.md,\s+"([^"]+)"')


def _headings(doc: str) -> set[str]:
  text = (REPO / "docs" / f"{doc}.md").read_text()
  return {m.group(1).strip() for m in re.finditer(r"^#+ (.+)$", text, re.M)}


def _joined(path: pathlib.Path) -> str:
  """The file with line breaks inside comments and docstrings folded to spaces."""
  return re.sub(r"\s*\n\s*(?:#|//|\*)?\s*", " ", path.read_text())


def test_every_cited_doc_section_exists():
  headings = {d: _headings(d) for d in ("NOTES", "ARCHITECTURE", "PERFORMANCE")}
  missing = []
  for folder in ("blink_jax", "nic_frontend", "ffi", "tests", "bench", "scripts"):
    for path in sorted((REPO / folder).rglob("*")):
      if path.suffix not in (".py", ".h", ".cc", ".cu", ".sh") or not path.is_file():
        continue
      for doc, heading in CITE.findall(_joined(path)):
        if heading not in headings[doc]:
          missing.append(f"{path.relative_to(REPO)}: docs/{doc}.md, {heading!r}")
  assert not missing, "\n".join(missing)


def test_readme_links_the_docs():
  readme = (REPO / "README.md").read_text()
  for doc in ("docs/ARCHITECTURE.md", "docs/PERFORMANCE.md"):
    assert f"]({doc})" in readme, doc
