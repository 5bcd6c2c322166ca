"""The gateway: one client for every upstream call, and one pure decoder per wire format.

`chat` is `/v1/chat/completions`, `messages` is Anthropic's `/v1/messages`; both turn SSE
records (from `sse`) into `events` values and know nothing of conversations.
"""
