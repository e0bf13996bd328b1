"""What the rest implements: abstractions and configs (``core``), user-facing experiment configs (``quickstart``)."""
