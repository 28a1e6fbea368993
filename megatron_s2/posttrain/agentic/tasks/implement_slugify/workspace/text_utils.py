def slugify(title):
    """URL slug of ``title`` (see the task)."""
    raise NotImplementedError
