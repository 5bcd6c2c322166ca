"""The chat server: `app` composes it; each folder below is one part of it (see the README's layout
table).
"""
