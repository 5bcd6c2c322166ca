"""Files people attach: stored per conversation or in a library, read in a limited child process,
searched by the model's attachment tools.
"""
