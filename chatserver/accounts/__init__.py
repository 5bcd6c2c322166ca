"""Who is asking: accounts, password and header login, sessions, throttles, and the `user` command."""
