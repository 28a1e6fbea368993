from text_utils import slugify


def test_example():
    assert slugify("Hello, World!") == "hello-world"
