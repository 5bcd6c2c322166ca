"""Search over a person's conversations: one SQLite FTS5 index of trigrams beside the store."""
