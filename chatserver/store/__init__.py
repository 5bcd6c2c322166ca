"""Where conversations live: the store protocol, the file store, the Redis store, migration between
them, and the change announcements pages follow.
"""
