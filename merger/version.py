"""merger's version: the CLI's --version, and what a resume manifest records (a resume across versions starts over)."""

__version__ = "0.1.0"
