"""One turn, from the person's message to the saved reply: the pipeline, context and compression,
the tool loop, checkpoints, titles, and the hub that lets a turn outlive its page.
"""
