"""Corpus listings: one reader per input format, the listing stream over them, and sharding."""
