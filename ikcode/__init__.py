"""ikcode: self-hosted Claude Code, fast and trustworthy."""

__version__ = "0.1.0"
