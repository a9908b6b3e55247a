"""Base tables and value types every layer uses: dtypes, errors, seeds, row-sparse values, checks, atomic
files."""
