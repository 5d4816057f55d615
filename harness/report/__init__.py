"""Self-contained HTML and markdown reports with embedded matplotlib plots."""
