from text_utils import slugify


def test_example():
    assert slugify("Hello, World!") == "hello-world"


def test_runs_and_ends():
    assert slugify("  --Mixed   CASE__and 42 numbers--  ") == "mixed-case-and-42-numbers"


def test_non_ascii_and_empty():
    assert slugify("Caf\u00e9 cr\u00e8me") == "caf-cr-me"
    assert slugify("!!!") == ""
