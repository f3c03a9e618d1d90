"""The operator's console at /ui: framework-free HTML and JavaScript shipped in the package."""
