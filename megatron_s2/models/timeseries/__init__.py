"""The time-series lane (Intern-S2 report §2.2.1): a family-neutral encoder any family can attach.

``patching`` plans the adaptive patch length (pure, no torch); ``encoder`` holds the module.
"""
