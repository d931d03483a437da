"""docs/FLAGS.md is the flag reference generated from SparseBalanceConfig (`make flags`): it must
be current, list every flag once, and keep each field's section."""

from pathlib import Path

from sparsebalance_megatron.arguments import sparsebalance_flags
from sparsebalance_megatron.flags import _sections, flags_markdown

REPO = Path(__file__).resolve().parents[2]


def test_flags_md_is_current():
    assert (REPO / "docs/FLAGS.md").read_text() == flags_markdown(), (
        "docs/FLAGS.md is out of date with SparseBalanceConfig: run `make flags`")


def test_every_flag_is_listed_once_under_its_section():
    text = flags_markdown()
    entries = [line.split("`")[1] for line in text.splitlines() if line.startswith("- `--")]
    assert sorted(entries) == sorted(sparsebalance_flags())
    sections = _sections()
    assert set(sections.values()) >= {"switches", "DST", "resume and logging"}
    # a field's section heading comes before it and no other heading sits between them
    lines = text.splitlines()
    head = None
    for line in lines:
        if line.startswith("## "):
            head = line[3:].lower()
        elif line.startswith("- `--sb-density`"):
            assert head == sections["density"].lower() == "attention budget"
