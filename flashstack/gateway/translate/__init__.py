"""Wire-format translators: each maps one protocol to and from the canonical types in core.py."""
