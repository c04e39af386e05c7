"""Model files. Flat, single-dot relative imports only: they ship as Hub remote code."""
